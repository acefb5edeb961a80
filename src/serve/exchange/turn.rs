//! Phase *wait turn* (`--saturation-admission`): the request's tenant and priority class, then
//! the flow control's verdict: straight on while some worker has room, else a wait in the
//! gateway (raced against the client leaving) or a refusal with `Retry-After`. A request let in
//! is then routed only among the workers that are not saturated.

use super::{Exchange, Forwarding, Lane};
use crate::admission::flow::{Ask, Denied, Fleet, RoomKey};
use crate::admission::queue::Priority;
use crate::admission::saturation::fair_share;
use crate::admission::FlowControl;
use crate::gateway::Gateway;
use crate::proxy::io::closed_by_peer;
use crate::route::extract::{BodyShape, MAX_ROUTING_TEXT};
use crate::serve::error::GatewayError;
use crate::serve::Outcome;
use crate::workers::role::Side;
use monoio::net::TcpStream;
use std::cell::OnceCell;

pub use crate::admission::PRIORITY_HEADER;
/// Workers counted per look at the fleet (a look lets in at most this many waiters).
const MOST_COUNTED: usize = 64;
/// The one room every request waits in: every worker of a side serves every routed request
/// (the policies choose among all of them), so the fleet a request waits for is the same.
const ROOM: RoomKey = 0;

/// How the wait ended when the request does not go on.
enum Turned {
    /// Answer this refusal.
    Refused(GatewayError),
    /// The client left while it waited: nothing to answer, nothing was sent upstream.
    ClientGone,
}

/// The workers of one side as the flow control sees them: eligible (healthy, circuit
/// admitting) and below the saturation thresholds.
struct SideFleet<'a> {
    gw: &'a Gateway,
    fc: &'a FlowControl,
    side: Side,
}

impl SideFleet<'_> {
    /// Calls `f` with this side's worker ids (the published list, borrowed: no copy).
    fn with_ids<R>(&self, f: impl FnOnce(&[crate::base::WorkerId]) -> R) -> R {
        f(self.gw.registry.load().ids_on(self.side))
    }

    /// Whether worker `w` of `ids` can take a request of `class` now: eligible and not
    /// saturated. `fair` keeps the side's fair share once one look needed it (only a worker
    /// without a reading does).
    fn has_room(
        &self,
        ids: &[crate::base::WorkerId],
        w: crate::base::WorkerId,
        class: Priority,
        fair: &OnceCell<u32>,
    ) -> bool {
        let loads = &self.gw.registry.loads;
        let share = || {
            *fair.get_or_init(|| {
                let eligible = ids.iter().filter(|&&i| loads.is_eligible(i));
                fair_share(eligible.map(|&i| loads.in_flight(i)))
            })
        };
        loads.is_eligible(w)
            && !self
                .fc
                .saturation
                .is_saturated(w, loads.in_flight(w), class, share)
    }
}

impl Fleet for SideFleet<'_> {
    fn room_for(&self, _room: RoomKey, class: Priority) -> usize {
        let fair = OnceCell::new();
        self.with_ids(|ids| {
            ids.iter()
                .filter(|&&w| self.has_room(ids, w, class, &fair))
                .take(MOST_COUNTED)
                .count()
        })
    }
}

/// The class a request claims: its `X-SMG-Priority` header, else its body's `priority`, else
/// 0. A header that is not an integer is refused (a typo must not silently demote a request).
pub(super) fn claimed_priority(
    header: Option<&[u8]>,
    body: Option<i64>,
) -> Result<Priority, GatewayError> {
    match header {
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .map(clamp_i32)
            .ok_or_else(|| {
                GatewayError::bad_request("X-SMG-Priority must be an integer (higher goes first)")
            }),
        None => Ok(body.map_or(0, clamp_i32)),
    }
}

/// How many generations a body asks for: its prompts (a `text` or `prompt` list, a list of
/// `input_ids` lists; else one) times its samples of each (`n`, or `/generate`'s
/// `sampling_params.n`; the larger when both are given). What the tenant's request limit counts.
pub(super) fn generations(shape: &BodyShape) -> u64 {
    let prompts = shape
        .text_list
        .or(shape.ids_lists)
        .or(shape.prompts)
        .map_or(1, |n| n.max(1) as u64);
    let samples = shape.n.max(shape.sampling_n).unwrap_or(1).max(1);
    prompts.saturating_mul(samples)
}

/// A cheap estimate of a request's whole prompt in tokens (what the tenant's token limit and
/// fairness count): the routing text's token ids when they were measured, else its token ids
/// (`/generate`'s `input_ids`, after the namespace's marker) counted, else about four characters a token. The routing text
/// stops at [`MAX_ROUTING_TEXT`] bytes; past that the count is scaled to the body's length (an
/// upper bound of the prompt's), so a long prompt is billed on all of it without reading it
/// twice.
pub(super) fn prompt_tokens(
    measured: Option<usize>,
    text: &str,
    token_ids: bool,
    body_len: usize,
) -> u64 {
    let counted = match measured {
        Some(n) => n as u64,
        None if token_ids => crate::route::extract::without_marker(text)
            .split_ascii_whitespace()
            .count() as u64,
        None => crate::base::text::char_count(text.as_bytes()) as u64 / 4,
    };
    // The text was cut (the cut may leave up to three bytes of room).
    let cut = text.len() + 4 > MAX_ROUTING_TEXT;
    let whole = if cut && !text.is_empty() {
        let scaled = counted as u128 * body_len as u128 / text.len() as u128;
        u64::try_from(scaled).unwrap_or(u64::MAX).max(counted)
    } else {
        counted
    };
    whole.max(1)
}

fn clamp_i32(v: i64) -> Priority {
    v.clamp(i64::from(Priority::MIN), i64::from(Priority::MAX)) as Priority
}

impl Exchange<'_> {
    /// Phase *wait turn* (see the module doc); a no-op without `--saturation-admission` and
    /// for pass-through calls. `lane`: the workers that compute the prompt (the fleet waited
    /// for); those found full are excluded from its picks.
    async fn wait_turn(&mut self, client: &TcpStream, lane: &mut Lane<'_>) -> Result<(), Turned> {
        let (Forwarding::Routed(_), Some(fc)) = (self.forwarding, self.gw.flow.as_ref()) else {
            return Ok(());
        };
        let head = self.head;
        let tenant = fc.tenant(head.headers());
        let claimed = claimed_priority(head.header(PRIORITY_HEADER), self.info.shape.priority)
            .map_err(Turned::Refused)?;
        let class = fc.flow.tenants().clamp(tenant, claimed);
        let shape = &self.info.shape;
        // The engine sees the class the gateway used: a `priority` the client put in the body
        // is replaced by it. None is added to a body without one (an engine without priority
        // scheduling refuses a request that carries one; the header is the gateway's own).
        self.engine_priority =
            (shape.priority_given && shape.priority != Some(i64::from(class))).then_some(class);
        let measured = match &self.prompt {
            Some(Ok(ids)) => Some(ids.len()),
            _ => None,
        };
        // A prompt of token ids was counted whole as it was read (a batch's every list).
        let tokens = match shape.token_count {
            Some(n) => n.max(1),
            None => prompt_tokens(
                measured,
                &self.info.text,
                self.info.token_ids,
                self.body.len(),
            ),
        };
        let requests = generations(shape);
        let fleet = SideFleet {
            gw: self.gw,
            fc,
            side: lane.side,
        };
        let ask = Ask {
            room: ROOM,
            class,
            tenant,
            tokens,
            requests,
        };
        match fc.flow.admit(ask, &fleet, closed_by_peer(client)).await {
            Ok(_) => {
                self.tenant = Some(tenant);
                self.admitted_tokens = tokens;
                // Routed among the workers with room when there are any: the cache-aware choice
                // among the unsaturated ones. The usual case, every worker with room, costs
                // one pass over the ids and no allocation (an empty Vec allocates nothing).
                let fair = OnceCell::new();
                let (full, all) = fleet.with_ids(|ids| {
                    let full: Vec<_> = ids
                        .iter()
                        .copied()
                        .filter(|&w| !fleet.has_room(ids, w, class, &fair))
                        .collect();
                    (full, ids.len())
                });
                if !full.is_empty() && full.len() < all {
                    lane.excluded.extend(full);
                }
                Ok(())
            }
            Err(Denied::ClientGone) => Err(Turned::ClientGone),
            Err(d) => Err(Turned::Refused(d.into())),
        }
    }

    /// Phase *wait turn*, and the answer when the request ends there (a refusal, or nothing
    /// for a client that left).
    pub(super) async fn wait_turn_or_answer(
        &mut self,
        client: &mut TcpStream,
        lane: &mut Lane<'_>,
    ) -> Option<Outcome> {
        // Traced: the wait is a span of its own (only where there is a waiting room).
        let started_ns = (self.gw.flow.is_some() && self.traced()).then(crate::trace::span::now_ns);
        let turned = self.wait_turn(client, lane).await;
        if let Some(start) = started_ns {
            self.traced_phase("queue_wait", start);
        }
        match turned {
            Ok(()) => None,
            Err(Turned::Refused(e)) => Some(self.fail(client, e).await),
            Err(Turned::ClientGone) => Some(self.client_gone("the client left while it waited")),
        }
    }

    /// The answer is over: its output tokens (stream events, else about four bytes a token of
    /// the body) count toward its tenant's share and token limit.
    pub(super) fn charge_output(&self, events: u64, body_bytes: u64) {
        if let (Some(fc), Some(t)) = (self.gw.flow.as_ref(), self.tenant) {
            let tokens = if events > 0 { events } else { body_bytes / 4 };
            fc.flow.charge_output(t, tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_counts_every_prompt_times_its_samples() {
        let shape = |f: &dyn Fn(&mut BodyShape)| {
            let mut s = BodyShape::default();
            f(&mut s);
            generations(&s)
        };
        assert_eq!(shape(&|_| {}), 1);
        assert_eq!(shape(&|s| s.text_list = Some(500)), 500);
        assert_eq!(shape(&|s| s.ids_lists = Some(7)), 7);
        assert_eq!(shape(&|s| s.prompts = Some(3)), 3);
        assert_eq!(shape(&|s| s.n = Some(8)), 8);
        assert_eq!(
            shape(&|s| {
                s.text_list = Some(10);
                s.sampling_n = Some(4)
            }),
            40
        );
        assert_eq!(shape(&|s| s.text_list = Some(0)), 1);
        assert_eq!(shape(&|s| s.n = Some(0)), 1);
        assert_eq!(
            shape(&|s| {
                s.prompts = Some(usize::MAX);
                s.n = Some(u64::MAX)
            }),
            u64::MAX
        );
    }

    #[test]
    fn a_long_prompt_is_billed_on_all_of_it() {
        // Short: four characters a token, or the ids counted.
        assert_eq!(prompt_tokens(None, "abcdefgh", false, 100), 2);
        assert_eq!(prompt_tokens(None, "1 22 333", true, 100), 3);
        // A namespace's marker in front of the ids is no token (even a marker glued to the
        // first id, or followed by a space).
        assert_eq!(
            prompt_tokens(None, "\u{1}0123456789abcdef\u{1} 1 22 333", true, 100),
            3
        );
        assert_eq!(
            prompt_tokens(None, "\u{1}0123456789abcdef\u{1}7", true, 100),
            1
        );
        assert_eq!(prompt_tokens(Some(9), "whatever", false, 100), 9);
        assert_eq!(prompt_tokens(None, "", false, 0), 1);
        // 1 MiB of text routed on its first 128 KiB: billed on the whole body.
        let cut = "a".repeat(MAX_ROUTING_TEXT);
        let body = 1 << 20;
        let t = prompt_tokens(None, &cut, false, body);
        assert!(t >= (body as u64) / 4, "{t}");
        let t = prompt_tokens(Some(MAX_ROUTING_TEXT / 4), &cut, false, body);
        assert!(t >= (body as u64) / 4, "{t}");
    }

    #[test]
    fn the_header_wins_over_the_body_and_bad_headers_are_refused() {
        assert_eq!(claimed_priority(Some(b" 7 "), Some(3)).unwrap(), 7);
        assert_eq!(claimed_priority(None, Some(3)).unwrap(), 3);
        assert_eq!(claimed_priority(None, None).unwrap(), 0);
        assert_eq!(claimed_priority(Some(b"-2"), None).unwrap(), -2);
        assert_eq!(
            claimed_priority(Some(b"99999999999"), None).unwrap(),
            Priority::MAX
        );
        assert_eq!(
            claimed_priority(None, Some(i64::MIN)).unwrap(),
            Priority::MIN
        );
        for bad in [&b"high"[..], b"1.5", b"", b"\xff"] {
            let e = claimed_priority(Some(bad), None).unwrap_err();
            assert_eq!(e.status, 400);
        }
    }
}
