//! The gateway's only body rewrites, spliced into the client's JSON bytes (never re-serialised:
//! every other byte, number formats and key order included, reaches the workers as the client
//! sent it). Pure.
//! - Prefill/decode disaggregation: the three bootstrap fields (`bootstrap_host`,
//!   `bootstrap_port`, `bootstrap_room`) that pair a prefill request with its decode twin.
//! - DP-aware routing (`--dp-aware`): `data_parallel_rank`, the attention-DP rank the request
//!   was routed to.
//! - The saturation admission: `priority`, the class the gateway used (the client's claim
//!   lowered to its tenant's maximum), in place of the client's.
//!
//! The fields go in just before the object's closing brace. Members of the same names a client
//! sent are taken out first (their bytes, with one comma), so the body carries the gateway's
//! values only, whatever a server does with duplicate keys (Python's `json` keeps the last,
//! others the first or refuse).

use super::extract::{Api, BodyShape};
use crate::base::json_span::{members, Member};
use std::io::Write as _;

/// Most items one batched request may pair (one room each): a larger batch or `n` is refused
/// rather than allocated for.
pub const MAX_BATCH: usize = 4096;

/// What the PD exchange needs to know of a body besides its routing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PdShape {
    /// Items of a batched request (`/generate` `text` list or `input_ids` list of lists,
    /// `/v1/completions` `prompt` list, chat `n` > 1): one bootstrap room each. `None`: one
    /// request, one room.
    pub batch: Option<usize>,
    /// `return_logprob` was asked for (`/generate`): prefill's input logprobs are merged.
    pub return_logprob: bool,
}

/// Why a body cannot take the gateway's fields (not an object) or cannot be paired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdBodyError(pub String);

/// How many rooms a body of `api` needs, and whether it asks for input logprobs, from the shape
/// the extractor read in its one pass over the body. A body whose fields have unexpected types
/// is one request (the servers judge it).
pub fn pd_shape(api: Api, body: &BodyShape) -> Result<PdShape, PdBodyError> {
    let batch = match api {
        Api::Generate => body.text_list.or(body.ids_lists),
        Api::Completions => body.prompts,
        Api::Chat => body
            .n
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
            .filter(|&n| n > 1),
        Api::TokenGenerate | Api::Embeddings | Api::Rerank | Api::Responses | Api::Messages => None,
    };
    if batch.is_some_and(|n| n > MAX_BATCH) {
        return Err(PdBodyError(format!(
            "a batch of more than {MAX_BATCH} items cannot be paired"
        )));
    }
    Ok(PdShape {
        batch,
        return_logprob: api == Api::Generate && body.return_logprob,
    })
}

/// The three fields for one paired request.
#[derive(Debug, Clone, Copy)]
pub struct Bootstrap<'a> {
    /// The prefill worker's host (IP literal or name, as its URL gives it).
    pub host: &'a str,
    /// The prefill worker's bootstrap port, or JSON `null`.
    pub port: Option<u16>,
    /// One room per item; a single room is written as a number, a batch's as a list.
    pub rooms: &'a [u64],
    /// Write the rooms as a list (a batched request), even of one.
    pub batch: bool,
}

/// Decimal digits of `n`.
fn digits(mut n: u64) -> usize {
    let mut d = 1;
    while n >= 10 {
        n /= 10;
        d += 1;
    }
    d
}

/// Bytes `host` takes as a JSON string body (escaped).
fn escaped_len(host: &str) -> usize {
    host.bytes()
        .map(|b| match b {
            b'"' | b'\\' => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

fn write_escaped(out: &mut Vec<u8>, host: &str) {
    for b in host.bytes() {
        match b {
            b'"' | b'\\' => out.extend_from_slice(&[b'\\', b]),
            0..=0x1f => {
                let _ = write!(out, "\\u{:04x}", b);
            }
            _ => out.push(b),
        }
    }
}

/// The fields as JSON members (no surrounding separators): their exact length.
fn members_len(b: &Bootstrap) -> usize {
    let port = b.port.map_or(4, |p| digits(u64::from(p)));
    let rooms = if b.batch {
        2 + b.rooms.iter().map(|&r| digits(r)).sum::<usize>() + b.rooms.len().saturating_sub(1)
    } else {
        b.rooms.first().map_or(4, |&r| digits(r))
    };
    r#""bootstrap_host":"#.len()
        + 2
        + escaped_len(b.host)
        + r#","bootstrap_port":"#.len()
        + port
        + r#","bootstrap_room":"#.len()
        + rooms
}

fn write_members(out: &mut Vec<u8>, b: &Bootstrap) {
    out.extend_from_slice(br#""bootstrap_host":""#);
    write_escaped(out, b.host);
    out.extend_from_slice(br#"","bootstrap_port":"#);
    match b.port {
        Some(p) => {
            let _ = write!(out, "{p}");
        }
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(br#","bootstrap_room":"#);
    if b.batch {
        out.push(b'[');
        for (i, r) in b.rooms.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = write!(out, "{r}");
        }
        out.push(b']');
    } else {
        match b.rooms.first() {
            Some(r) => {
                let _ = write!(out, "{r}");
            }
            None => out.extend_from_slice(b"null"),
        }
    }
}

/// Every field the gateway adds to one body: PD's bootstrap fields, DP-aware's rank, or both.
#[derive(Debug, Clone, Copy, Default)]
pub struct Added<'a> {
    /// The bootstrap fields of a paired (PD) request.
    pub bootstrap: Option<Bootstrap<'a>>,
    /// The attention-DP rank the request goes to (`data_parallel_rank`).
    pub dp_rank: Option<u32>,
    /// PD with DP ranks, on the decode side: the rank its prefill twin runs on
    /// (`disagg_prefill_dp_rank`), so the decode server pairs with that rank's KV.
    pub prefill_dp_rank: Option<u32>,
    /// The priority class the gateway used (`priority`), replacing the client's member of that
    /// name; `None` leaves a client's `priority` as it is.
    pub priority: Option<i32>,
}

const DP_RANK_KEY: &[u8] = br#""data_parallel_rank":"#;
const PREFILL_DP_RANK_KEY: &[u8] = br#""disagg_prefill_dp_rank":"#;
const PRIORITY_KEY: &[u8] = br#""priority":"#;

/// Characters of `v` in decimal, its sign included.
fn signed_digits(v: i32) -> usize {
    usize::from(v < 0) + digits(u64::from(v.unsigned_abs()))
}

/// The added members' exact length (without a leading comma).
fn added_len(a: &Added) -> usize {
    let boot = a.bootstrap.as_ref().map_or(0, members_len);
    let rank = |key: &[u8], r: Option<u32>| r.map_or(0, |r| key.len() + digits(u64::from(r)));
    let parts = [
        boot,
        rank(DP_RANK_KEY, a.dp_rank),
        rank(PREFILL_DP_RANK_KEY, a.prefill_dp_rank),
        a.priority
            .map_or(0, |p| PRIORITY_KEY.len() + signed_digits(p)),
    ];
    let present = parts.iter().filter(|&&n| n > 0).count();
    parts.iter().sum::<usize>() + present.saturating_sub(1)
}

fn write_added(out: &mut Vec<u8>, a: &Added) {
    let mut first = true;
    let mut sep = |out: &mut Vec<u8>| {
        if !std::mem::replace(&mut first, false) {
            out.push(b',');
        }
    };
    if let Some(b) = &a.bootstrap {
        sep(out);
        write_members(out, b);
    }
    for (key, r) in [
        (DP_RANK_KEY, a.dp_rank),
        (PREFILL_DP_RANK_KEY, a.prefill_dp_rank),
    ] {
        if let Some(r) = r {
            sep(out);
            out.extend_from_slice(key);
            let _ = write!(out, "{r}");
        }
    }
    if let Some(p) = a.priority {
        sep(out);
        out.extend_from_slice(PRIORITY_KEY);
        let _ = write!(out, "{p}");
    }
}

/// `body` (a JSON object, as the extractor already checked) with the bootstrap fields spliced
/// in before its closing brace: one allocation of the exact size, every original byte kept.
pub fn splice(body: &[u8], b: &Bootstrap) -> Result<Vec<u8>, PdBodyError> {
    splice_fields(
        body,
        &Added {
            bootstrap: Some(*b),
            ..Added::default()
        },
    )
}

/// `body` with `"data_parallel_rank": rank` spliced in before its closing brace (`--dp-aware`).
pub fn splice_dp_rank(body: &[u8], rank: u32) -> Result<Vec<u8>, PdBodyError> {
    splice_fields(
        body,
        &Added {
            dp_rank: Some(rank),
            ..Added::default()
        },
    )
}

/// `body` with `added`'s fields (a DP rank, the gateway's priority class, or both), or the
/// body itself when there is nothing to add.
pub fn splice_routed(body: &[u8], added: &Added) -> Result<Option<Vec<u8>>, PdBodyError> {
    if added.bootstrap.is_none()
        && added.dp_rank.is_none()
        && added.prefill_dp_rank.is_none()
        && added.priority.is_none()
    {
        return Ok(None);
    }
    splice_fields(body, added).map(Some)
}

/// The keys the gateway always sets: a client's members of these names are replaced.
const GATEWAY_KEYS: [&[u8]; 5] = [
    b"bootstrap_host",
    b"bootstrap_port",
    b"bootstrap_room",
    b"data_parallel_rank",
    b"disagg_prefill_dp_rank",
];
/// The key the gateway sets when it has a class to give (a client's member is replaced then,
/// and only then).
const PRIORITY: &[u8] = b"priority";

/// Byte ranges of the top-level members of `body` (a JSON object the extractor accepted) whose
/// key is in `keys`, with their commas, so removing them leaves valid JSON.
fn member_spans(body: &[u8], keys: &[&[u8]]) -> Vec<(usize, usize)> {
    let Some(open) = body.iter().position(|&c| c == b'{') else {
        return Vec::new();
    };
    let all: Vec<Member<'_>> = members(body, open).collect();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < all.len() {
        if !keys.contains(&all[i].key) {
            i += 1;
            continue;
        }
        // A run of removed members, all[i..j].
        let mut j = i + 1;
        while j < all.len() && keys.contains(&all[j].key) {
            j += 1;
        }
        spans.push(
            match (all.get(j), i.checked_sub(1).and_then(|p| all.get(p))) {
                // Up to the next kept member's key: the run, its commas, the space after.
                (Some(next), _) => (all[i].at, next.at),
                // The run ends the object: from the end of the previous kept value (its comma).
                (None, Some(prev)) => (prev.end, all[j - 1].end),
                (None, None) => (all[i].at, all[j - 1].end),
            },
        );
        i = j;
    }
    spans
}

/// `body` (a JSON object) with the `added` fields spliced in before its closing brace, members
/// of the same names the client sent taken out: one allocation of the exact size, every other
/// byte kept.
pub fn splice_fields(body: &[u8], added: &Added) -> Result<Vec<u8>, PdBodyError> {
    // A client's own members of the gateway's keys (rare: scanned only when one is there).
    let priority = added.priority.is_some();
    if named_anywhere(body, priority) {
        let mut keys: Vec<&[u8]> = GATEWAY_KEYS.to_vec();
        if priority {
            keys.push(PRIORITY);
        }
        let spans = member_spans(body, &keys);
        if !spans.is_empty() {
            let mut kept = Vec::with_capacity(body.len());
            let mut at = 0;
            for (a, b) in spans {
                kept.extend_from_slice(&body[at..a]);
                at = b;
            }
            kept.extend_from_slice(&body[at..]);
            return splice_checked(&kept, added);
        }
    }
    splice_checked(body, added)
}

/// Whether one of the gateway's keys (`priority` among them when `priority`) occurs anywhere in
/// `body` as a quoted string (a quick test, at memory speed, before the member scan).
fn named_anywhere(body: &[u8], priority: bool) -> bool {
    static KEYS: std::sync::OnceLock<Option<aho_corasick::AhoCorasick>> =
        std::sync::OnceLock::new();
    let found = KEYS.get_or_init(|| {
        let mut all = GATEWAY_KEYS.to_vec();
        all.push(PRIORITY);
        aho_corasick::AhoCorasick::new(all.into_iter().map(|k| {
            let mut q = Vec::with_capacity(k.len() + 2);
            q.push(b'"');
            q.extend_from_slice(k);
            q.push(b'"');
            q
        }))
        .ok()
    });
    // Without the automaton (it cannot fail for these keys), scan every time. The priority
    // key is the last pattern.
    found.as_ref().is_none_or(|ac| {
        ac.find_iter(body)
            .any(|m| priority || m.pattern().as_usize() < GATEWAY_KEYS.len())
    })
}

fn splice_checked(body: &[u8], added: &Added) -> Result<Vec<u8>, PdBodyError> {
    let not_object = || PdBodyError("the request body must be a JSON object".into());
    let start = body
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .ok_or_else(not_object)?;
    let close = body
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .ok_or_else(not_object)?;
    if body[start] != b'{' || body[close] != b'}' || close <= start {
        return Err(not_object());
    }
    let members = added_len(added);
    // The object is empty when only whitespace separates its braces.
    let empty = body[start + 1..close]
        .iter()
        .all(|c| c.is_ascii_whitespace());
    let comma = !empty && members > 0;
    let len = body.len() + members + usize::from(comma);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&body[..close]);
    if comma {
        out.push(b',');
    }
    write_added(&mut out, added);
    out.extend_from_slice(&body[close..]);
    debug_assert_eq!(out.len(), len, "the capacity is exact");
    Ok(out)
}

/// A bootstrap room: a random 63-bit integer (the reference masks a u64 the same way, so every
/// room fits a signed 64-bit integer on the servers).
pub fn room(random: u64) -> u64 {
    random & (u64::MAX >> 1)
}

#[cfg(test)]
mod tests;
