//! One publisher's stream of batches, pure (no sockets, no clocks): which sequence numbers to
//! deliver, when to ask the replay socket and for what, what a replay's answer proves, when the
//! index must forget the publisher's blocks, and when what it holds is complete.
//!
//! **Silence is not a gap.** A server is quiet whenever nothing is stored or evicted, so the
//! replay socket is asked only when something happened:
//! - once the live socket is first subscribed ([`Purpose::Warm`]: everything the publisher
//!   still buffers; or [`Purpose::Resume`] after a sibling's copy, from its watermark on);
//! - on a sequence jump ([`Purpose::Fill`]: the missing batches);
//! - when the live socket was subscribed again after a drop ([`Purpose::Reconnect`]: what was
//!   published while it was down);
//! - when a live number goes back ([`Purpose::CheckRestart`]: a new server process, or a bad
//!   message).
//!
//! The start-up and reconnect replays follow the subscription, never precede it: a PUB drops
//! what it publishes before a subscription reaches it, so a replay that ran first would leave
//! a window whose batches neither the buffer answer nor the live stream carries (the last
//! batch before a quiet spell would then be missing until the next one).
//!
//! **A replay proves who is talking.** Except for the start-up and resume replays, the request
//! starts at the last delivered batch, whose payload fingerprint (XXH3-64) is kept: a publisher
//! whose buffer holds that batch byte for byte is the process we streamed from, and what follows
//! it fills the hole. A buffer that ends before the number a live message claimed proves that
//! message was never published (a corrupt or hostile frame): it is dropped, nothing is reset, so
//! one bad message cannot cost a worker its blocks. A buffer whose first batch comes after ours
//! means the hole cannot be filled: the publisher's blocks are reset and the rest of that buffer
//! rebuilds them (what was stored before it is missing: the index under-estimates, never
//! over-estimates). A different batch under our number, or no batch at all, means a new process:
//! reset, then its whole buffer.
//!
//! While a replay is wanted or running, the live stream is not read (the publisher's own queue
//! and the socket hold it), so batches are delivered strictly in order; live numbers the replay
//! already delivered are duplicates. A replay that cannot be had (no answer, refused, broken off)
//! proves nothing: at start-up the stream is taken as it comes; for a gap the publisher is reset
//! and its stream goes on from the batch at hand; after a reconnect nothing changes; for a number
//! going back the publisher is reset as restarted.

use super::ResetReason;
use crate::kv::wire::{self, EventBatch};
use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

/// Replays of one episode retried after a reply went missing mid-stream (the replay socket's own
/// queue dropped it) before the replay counts as failed.
const MAX_ATTEMPTS: u32 = 3;

/// Why a replay is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Everything the publisher still buffers, from its oldest batch: the index is complete
    /// when it ends.
    Warm,
    /// From a sibling copy's watermark on (`--kv-bootstrap-peer`).
    Resume,
    /// Batches the live stream skipped (up to the held message).
    Fill,
    /// What was published while the live connection was down.
    Reconnect,
    /// A live number went back: a restarted publisher, or a bad message.
    CheckRestart,
}

impl Purpose {
    /// A short name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Warm => "start-up",
            Purpose::Resume => "resume",
            Purpose::Fill => "gap fill",
            Purpose::Reconnect => "reconnect",
            Purpose::CheckRestart => "restart check",
        }
    }
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Hand this batch to the sink.
    Deliver {
        /// Its sequence number.
        seq: i64,
        /// Its events.
        batch: EventBatch,
        /// It came from the replay socket.
        replayed: bool,
    },
    /// Forget everything this publisher reported so far (then the stream goes on).
    Reset(ResetReason),
    /// A sequence jump was seen (counted).
    Gap,
    /// A message was refused (counted, logged): why.
    Malformed(String),
    /// The replay under way ended or failed: close its connection (`why` for the log when it
    /// failed).
    ReplayDone {
        /// Why it failed, `None` when it answered in full.
        failed: Option<String>,
    },
}

/// One reply of the replay socket, already split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A buffered batch.
    Batch {
        /// Its sequence number.
        seq: i64,
        /// Its payload (the live payload, byte for byte).
        payload: Bytes,
    },
    /// No more batches.
    End,
}

/// A live message waiting for a replay to end.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    seq: i64,
    payload: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Replay {
    purpose: Purpose,
    /// The sequence number asked from.
    from: i64,
    /// The first reply must be this batch (number, fingerprint) for the stream to be ours.
    verify: Option<(i64, u64)>,
    /// The next number to deliver (after verification).
    next: Option<i64>,
    /// The request was sent.
    sent: bool,
    held: Option<Held>,
    /// Replies delivered by this replay.
    delivered: u64,
    /// Attempts of this episode so far.
    attempts: u32,
}

/// One publisher's stream (see the module doc).
#[derive(Debug, Clone)]
pub struct Stream {
    has_replay: bool,
    /// Last delivered number and its payload's fingerprint (`None` fingerprint: set by a
    /// sibling's watermark, or -1 after a start-up replay found nothing buffered, so the
    /// publisher's next number is 0: nothing to compare).
    last: Option<(i64, Option<u64>)>,
    /// Live numbers from this one up to `last` were delivered by a replay: duplicates.
    dup_floor: Option<i64>,
    /// What the index holds is all the publisher's buffer can tell.
    complete: bool,
    replay: Option<Replay>,
    /// Most replies one replay may deliver before it counts as broken.
    max_replies: u64,
    /// The live socket was subscribed before: the next subscription is a reconnect.
    subscribed_once: bool,
    /// Which KV-cache groups hold each block (vLLM hybrid models), for the batches to come.
    groups: wire::Groups,
}

impl Stream {
    /// A new subscription (resuming after `resume`, a sibling copy's watermark, when given).
    /// Its start-up replay is wanted once the live socket is subscribed ([`Stream::subscribed`]).
    pub fn new(has_replay: bool, resume: Option<i64>, max_replies: u64) -> Stream {
        Stream {
            has_replay,
            last: resume.map(|r| (r, None)),
            dup_floor: None,
            complete: false,
            replay: None,
            max_replies: max_replies.max(1),
            subscribed_once: false,
            groups: wire::Groups::default(),
        }
    }

    /// The index forgets the publisher's blocks: so do its KV-cache groups.
    fn reset(&mut self, why: ResetReason, out: &mut Vec<Step>) {
        self.groups.clear();
        out.push(Step::Reset(why));
    }

    /// Whether what the index holds for this publisher is complete (as complete as its replay
    /// buffer allows) and in order.
    pub fn is_complete(&self) -> bool {
        self.complete && self.replay.is_none()
    }

    /// Whether a replay is wanted or under way (the live stream is not read meanwhile).
    pub fn is_replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// The replay to send, when one is wanted and not sent yet: its purpose and start.
    pub fn wanted(&self) -> Option<(Purpose, i64)> {
        self.replay
            .as_ref()
            .filter(|r| !r.sent)
            .map(|r| (r.purpose, r.from))
    }

    /// The wanted replay's request went out.
    pub fn sent(&mut self) {
        if let Some(r) = &mut self.replay {
            r.sent = true;
        }
    }

    /// The last delivered sequence number (the watermark of an index copy).
    pub fn last(&self) -> Option<i64> {
        self.last.map(|(s, _)| s).filter(|&s| s >= 0)
    }

    fn want(
        &mut self,
        purpose: Purpose,
        from: i64,
        verify: Option<(i64, u64)>,
        held: Option<Held>,
        attempts: u32,
    ) {
        self.replay = Some(Replay {
            purpose,
            from,
            verify,
            next: None,
            sent: false,
            held,
            delivered: 0,
            attempts,
        });
    }

    /// Ask from the last delivered batch, verifying it (or, after a sibling's watermark that
    /// has no fingerprint, from the batch after it).
    fn want_from_last(&mut self, purpose: Purpose, held: Option<Held>) {
        match self.last {
            Some((l, Some(fp))) => self.want(purpose, l, Some((l, fp)), held, 0),
            Some((l, None)) => self.want(purpose, l.saturating_add(1), None, held, 0),
            None => self.want(Purpose::Warm, 0, None, held, 0),
        }
    }

    /// The live socket is subscribed (its peer's handshake done, our subscription sent): the
    /// first time, the start-up replay; after a drop, what was published meanwhile.
    pub fn subscribed(&mut self) {
        let first = !std::mem::replace(&mut self.subscribed_once, true);
        if !self.has_replay || self.replay.is_some() {
            return;
        }
        match self.last {
            Some((r, None)) if first => {
                self.want(Purpose::Resume, r.saturating_add(1), None, None, 0)
            }
            None => self.want(Purpose::Warm, 0, None, None, 0),
            Some(_) => self.want_from_last(Purpose::Reconnect, None),
        }
    }

    /// A live message (only while [`Stream::is_replaying`] is false).
    pub fn live(&mut self, seq: i64, payload: Bytes, out: &mut Vec<Step>) {
        if self.replay.is_some() {
            // The driver stops reading live while a replay is wanted; keep the order anyway.
            debug_assert!(false, "live message during a replay");
            return;
        }
        let Some((last, _)) = self.last else {
            self.accept(seq, payload, false, out);
            if !self.has_replay {
                self.complete = true;
            }
            return;
        };
        if seq == last.wrapping_add(1) && seq > last {
            self.dup_floor = None;
            self.accept(seq, payload, false, out);
        } else if seq > last {
            out.push(Step::Gap);
            if self.has_replay {
                self.want_from_last(Purpose::Fill, Some(Held { seq, payload }));
            } else {
                self.reset(ResetReason::Gap, out);
                self.dup_floor = None;
                self.accept(seq, payload, false, out);
            }
        } else if self.dup_floor.is_some_and(|f| seq >= f) {
            // Delivered already by a replay that read ahead of the live queue.
        } else if self.has_replay {
            self.want_from_last(Purpose::CheckRestart, Some(Held { seq, payload }));
        } else {
            self.reset(ResetReason::Restarted, out);
            self.last = None;
            self.dup_floor = None;
            self.accept(seq, payload, false, out);
        }
    }

    /// Decode and deliver one batch as the new last (an unreadable one, or one that lost a
    /// removal, resets the publisher instead: from it on, the stream is again the truth, and
    /// what came before it may hide a removal).
    fn accept(&mut self, seq: i64, payload: Bytes, replayed: bool, out: &mut Vec<Step>) {
        let fp = fingerprint(&payload);
        match wire::decode_batch_in(&payload, &mut self.groups) {
            Ok(batch) if batch.skipped.lossy == 0 => out.push(Step::Deliver {
                seq,
                batch,
                replayed,
            }),
            Ok(_) => self.reset(ResetReason::Unreadable, out),
            Err(e) => {
                out.push(Step::Malformed(format!("batch {seq}: {e}")));
                self.reset(ResetReason::Unreadable, out);
            }
        }
        self.last = Some((seq, Some(fp)));
    }

    /// One reply of the replay under way.
    pub fn reply(&mut self, reply: Reply, out: &mut Vec<Step>) {
        let Some(mut r) = self.replay.take() else {
            return; // A reply to a replay already given up: its connection is being closed.
        };
        if let Some((vseq, vfp)) = r.verify {
            // The first reply tells whose buffer this is.
            match reply {
                Reply::Batch { seq, ref payload } if seq == vseq && fingerprint(payload) == vfp => {
                    r.verify = None;
                    r.next = Some(seq.saturating_add(1));
                    self.replay = Some(r);
                }
                Reply::Batch { seq, payload } if seq > vseq => {
                    // Our last batch is no longer buffered: the hole cannot be filled. What the
                    // buffer holds rebuilds the publisher.
                    self.reset(ResetReason::Gap, out);
                    self.rebuild_from(r, seq, payload, out);
                }
                _ => self.restarted(r, out),
            }
            return;
        }
        match reply {
            Reply::End => self.finish(r, out),
            Reply::Batch { seq, payload } => {
                let next = r.next;
                match next {
                    // The first batch of a start-up replay may be any (the buffer's oldest).
                    None if r.purpose == Purpose::Warm => self.rebuild_from(r, seq, payload, out),
                    // A resume must continue right after the watermark.
                    None if seq == r.from => {
                        r.next = Some(seq);
                        self.replay = Some(r);
                        self.reply(Reply::Batch { seq, payload }, out);
                    }
                    None if seq > r.from => {
                        self.reset(ResetReason::Gap, out);
                        self.rebuild_from(r, seq, payload, out);
                    }
                    None => self.replay = Some(r),
                    Some(n) if seq < n => self.replay = Some(r),
                    Some(n) if seq > n => self.retry(r, format!("reply {n} went missing"), out),
                    Some(_) => {
                        if r.delivered >= self.max_replies {
                            return self.fail(r, "more batches than a replay may hold".into(), out);
                        }
                        self.deliver_replayed(&mut r, seq, payload, out);
                        self.replay = Some(r);
                    }
                }
            }
        }
    }

    fn deliver_replayed(&mut self, r: &mut Replay, seq: i64, payload: Bytes, out: &mut Vec<Step>) {
        if self.dup_floor.is_none() {
            self.dup_floor = Some(seq);
        }
        self.accept(seq, payload, true, out);
        r.next = Some(seq.saturating_add(1));
        r.delivered += 1;
    }

    /// Deliver the rest of a buffer from `seq` on as the publisher's whole state (after a reset,
    /// or at start-up).
    fn rebuild_from(&mut self, mut r: Replay, seq: i64, payload: Bytes, out: &mut Vec<Step>) {
        r.purpose = Purpose::Warm;
        r.verify = None;
        self.dup_floor = None;
        self.deliver_replayed(&mut r, seq, payload, out);
        self.replay = Some(r);
    }

    /// Not the process we streamed from: reset, then its whole buffer.
    fn restarted(&mut self, r: Replay, out: &mut Vec<Step>) {
        out.push(Step::ReplayDone { failed: None });
        self.reset(ResetReason::Restarted, out);
        self.last = None;
        self.dup_floor = None;
        self.complete = false;
        self.want(Purpose::Warm, 0, None, r.held, 0);
    }

    /// The replay answered in full.
    fn finish(&mut self, r: Replay, out: &mut Vec<Step>) {
        out.push(Step::ReplayDone { failed: None });
        match r.purpose {
            Purpose::Warm | Purpose::Resume => self.complete = true,
            Purpose::Fill | Purpose::Reconnect | Purpose::CheckRestart => {}
        }
        if self.last.is_none() {
            // An empty buffer: the publisher has sent nothing yet, so its first number is 0
            // and a first live message claiming another is checked like any jump.
            self.last = Some((-1, None));
        }
        if let Some(h) = r.held {
            let last = self.last.map(|(s, _)| s);
            match r.purpose {
                // The publisher's own buffer never had the number this message claimed.
                Purpose::Fill if last.is_some_and(|l| h.seq > l.saturating_add(1)) => {
                    out.push(Step::Malformed(format!(
                        "batch {} claimed a sequence number its publisher never sent (its \
                         buffer ends at {}); dropped",
                        h.seq,
                        last.unwrap_or_default()
                    )))
                }
                // Same process, and PUB never sends a number twice.
                Purpose::CheckRestart => out.push(Step::Malformed(format!(
                    "batch {} went back in sequence although its publisher did not restart; \
                     dropped",
                    h.seq
                ))),
                _ => self.live(h.seq, h.payload, out),
            }
        }
    }

    /// A reply went missing mid-stream: ask again from the last delivered batch.
    fn retry(&mut self, r: Replay, why: String, out: &mut Vec<Step>) {
        if r.attempts + 1 >= MAX_ATTEMPTS {
            return self.fail(r, why, out);
        }
        out.push(Step::ReplayDone {
            failed: Some(why.clone()),
        });
        // What was delivered stays; the rest follows (a start-up replay resumes where it was).
        let attempts = r.attempts + 1;
        self.want_from_last(r.purpose, r.held);
        if let Some(n) = &mut self.replay {
            n.attempts = attempts;
        }
    }

    /// The replay under way could not be had (its socket unreachable or refusing, no answer
    /// in time, broken off, malformed), whether or not its request went out.
    pub fn failed(&mut self, why: String, out: &mut Vec<Step>) {
        if let Some(r) = self.replay.take() {
            self.fail(r, why, out);
        }
    }

    fn fail(&mut self, r: Replay, why: String, out: &mut Vec<Step>) {
        out.push(Step::ReplayDone { failed: Some(why) });
        match r.purpose {
            // Nothing more can be learnt: the stream is taken as it comes.
            Purpose::Warm | Purpose::Resume => self.complete = true,
            Purpose::Fill => {
                self.reset(ResetReason::Gap, out);
                self.last = None;
                self.dup_floor = None;
            }
            Purpose::Reconnect => {}
            Purpose::CheckRestart => {
                self.reset(ResetReason::Restarted, out);
                self.last = None;
                self.dup_floor = None;
            }
        }
        if let Some(h) = r.held {
            self.live(h.seq, h.payload, out);
        }
    }
}

/// What tells two batches of one number apart (a restarted publisher's batch N from the one
/// this stream had): their length and their first and last 4 KiB (a batch starts with its
/// timestamp). Constant time whatever the payload's size, so a publisher sending max-size
/// messages costs the event thread their reading, not a hash of every byte.
fn fingerprint(payload: &[u8]) -> u64 {
    const EDGE: usize = 4 << 10;
    if payload.len() <= 2 * EDGE {
        return xxh3_64(payload);
    }
    let head = xxh3_64(&payload[..EDGE]);
    let tail = xxh3_64(&payload[payload.len() - EDGE..]);
    head ^ tail.rotate_left(29) ^ (payload.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[cfg(test)]
mod tests;
