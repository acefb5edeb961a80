use super::*;
use crate::kv::wire::{encode_batch, EventBatch, Form};
use proptest::prelude::*;

/// A batch whose payload names its number and the process that sent it (so two processes'
/// batch 10 differ, as a real restarted server's would).
fn payload(process: u32, seq: i64) -> Bytes {
    let batch = EventBatch {
        ts: Some(f64::from(process) * 1e6 + seq as f64),
        ..EventBatch::default()
    };
    Bytes::from(encode_batch(&batch, Form::Array))
}

/// What the steps did, compactly: delivered numbers (r = replayed), resets, drops.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    delivered: Vec<(i64, bool)>,
    resets: Vec<ResetReason>,
    malformed: usize,
    gaps: usize,
    failed: Vec<String>,
    done: usize,
}

fn seen(steps: &[Step], into: &mut Seen) {
    for s in steps {
        match s {
            Step::Deliver { seq, replayed, .. } => into.delivered.push((*seq, *replayed)),
            Step::Reset(r) => into.resets.push(*r),
            Step::Malformed(_) => into.malformed += 1,
            Step::Gap => into.gaps += 1,
            Step::ReplayDone { failed: Some(w) } => into.failed.push(w.clone()),
            Step::ReplayDone { failed: None } => into.done += 1,
        }
    }
}

/// A publisher as SGLang's: a counter from 0 and a buffer of its last `keep` batches.
struct Publisher {
    process: u32,
    next: i64,
    buffer: Vec<(i64, Bytes)>,
    keep: usize,
}

impl Publisher {
    fn new(process: u32) -> Self {
        Publisher {
            process,
            next: 0,
            buffer: Vec::new(),
            keep: 10_000,
        }
    }
    fn publish(&mut self) -> (i64, Bytes) {
        let seq = self.next;
        self.next += 1;
        let p = payload(self.process, seq);
        self.buffer.push((seq, p.clone()));
        if self.buffer.len() > self.keep {
            self.buffer.remove(0);
        }
        (seq, p)
    }
    fn answer(&self, from: i64) -> Vec<Reply> {
        let mut r: Vec<Reply> = self
            .buffer
            .iter()
            .filter(|(s, _)| *s >= from)
            .map(|(seq, payload)| Reply::Batch {
                seq: *seq,
                payload: payload.clone(),
            })
            .collect();
        r.push(Reply::End);
        r
    }
}

/// Serve every replay the stream wants from `p` until it wants none.
fn serve(s: &mut Stream, p: &Publisher, log: &mut Seen) {
    let mut rounds = 0;
    while let Some((_, from)) = s.wanted() {
        rounds += 1;
        assert!(rounds < 10, "replays never settle");
        s.sent();
        for reply in p.answer(from) {
            let mut out = Vec::new();
            s.reply(reply, &mut out);
            seen(&out, log);
            if s.wanted().is_some() || !s.is_replaying() {
                break;
            }
        }
    }
}

fn live(s: &mut Stream, seq: i64, payload: Bytes, log: &mut Seen) {
    let mut out = Vec::new();
    s.live(seq, payload, &mut out);
    seen(&out, log);
}

#[test]
fn without_replay_the_stream_is_taken_as_it_comes() {
    let mut s = Stream::new(false, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    assert_eq!(s.wanted(), None);
    assert!(!s.is_complete());
    live(&mut s, 7, payload(0, 7), &mut log);
    assert!(s.is_complete(), "complete from its first batch");
    live(&mut s, 8, payload(0, 8), &mut log);
    live(&mut s, 11, payload(0, 11), &mut log);
    live(&mut s, 2, payload(1, 2), &mut log);
    assert_eq!(
        log.delivered,
        [(7, false), (8, false), (11, false), (2, false)]
    );
    assert_eq!(log.resets, [ResetReason::Gap, ResetReason::Restarted]);
    assert!(s.is_complete());
}

#[test]
fn start_up_replay_takes_the_buffer_from_its_oldest_batch() {
    let mut p = Publisher::new(0);
    p.keep = 3;
    for _ in 0..6 {
        p.publish();
    }
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    assert_eq!(s.wanted(), Some((Purpose::Warm, 0)));
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    assert_eq!(log.delivered, [(3, true), (4, true), (5, true)]);
    assert!(s.is_complete() && log.resets.is_empty());
    // Live 4 and 5 were queued while the replay ran: duplicates. 6 follows.
    live(&mut s, 4, payload(0, 4), &mut log);
    live(&mut s, 5, payload(0, 5), &mut log);
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    assert_eq!(log.delivered.last(), Some(&(6, false)));
    assert_eq!(log.delivered.len(), 4);
    // After a live batch past the replay, a lower number is no duplicate any more.
    live(&mut s, 5, payload(0, 5), &mut log);
    assert_eq!(s.wanted(), Some((Purpose::CheckRestart, 6)));
}

#[test]
fn silence_asks_nothing() {
    let mut p = Publisher::new(0);
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    // However long nothing arrives, the stream wants nothing and stays complete.
    assert_eq!(s.wanted(), None);
    assert!(s.is_complete());
}

#[test]
fn a_gap_is_filled_from_the_buffer_after_proving_it_is_the_same_stream() {
    let mut p = Publisher::new(0);
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    for _ in 0..3 {
        let (seq, pl) = p.publish();
        live(&mut s, seq, pl, &mut log);
    }
    // 3 and 4 are lost on the way; 5 arrives.
    p.publish();
    p.publish();
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    assert_eq!(log.gaps, 1);
    assert_eq!(
        s.wanted(),
        Some((Purpose::Fill, 2)),
        "from the last delivered"
    );
    assert!(!s.is_complete(), "scored by the text tree while replaying");
    serve(&mut s, &p, &mut log);
    let order: Vec<i64> = log.delivered.iter().map(|d| d.0).collect();
    assert_eq!(order, [0, 1, 2, 3, 4, 5]);
    assert!(log.resets.is_empty() && log.malformed == 0);
    assert!(s.is_complete());
}

#[test]
fn a_number_far_ahead_that_the_buffer_never_had_is_dropped_without_a_reset() {
    let mut p = Publisher::new(0);
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    for _ in 0..3 {
        let (seq, pl) = p.publish();
        live(&mut s, seq, pl, &mut log);
    }
    live(&mut s, 1_000_000, payload(9, 1_000_000), &mut log);
    serve(&mut s, &p, &mut log);
    assert_eq!(log.malformed, 1);
    assert!(log.resets.is_empty(), "{:?}", log.resets);
    assert!(s.is_complete());
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    assert_eq!(log.delivered.last(), Some(&(3, false)));
}

#[test]
fn a_hole_the_buffer_cannot_fill_resets_and_rebuilds_from_what_it_holds() {
    let mut p = Publisher::new(0);
    p.keep = 4;
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    for _ in 0..9 {
        p.publish();
    }
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    serve(&mut s, &p, &mut log);
    assert_eq!(log.resets, [ResetReason::Gap]);
    let replayed: Vec<i64> = log.delivered[1..].iter().map(|d| d.0).collect();
    assert_eq!(replayed, [7, 8, 9, 10]);
    assert!(s.is_complete());
}

#[test]
fn a_restarted_publisher_is_told_apart_from_a_bad_message() {
    // Same process, a number going back: a bad message, dropped.
    let mut p = Publisher::new(0);
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    for _ in 0..5 {
        let (seq, pl) = p.publish();
        live(&mut s, seq, pl, &mut log);
    }
    live(&mut s, 1, payload(7, 1), &mut log);
    assert_eq!(s.wanted(), Some((Purpose::CheckRestart, 4)));
    serve(&mut s, &p, &mut log);
    assert_eq!((log.malformed, log.resets.len()), (1, 0));

    // A new process that has published less than we had seen: its buffer has nothing from our
    // last number on. Reset, then its whole buffer.
    let mut q = Publisher::new(1);
    for _ in 0..2 {
        q.publish();
    }
    let (seq, pl) = q.publish();
    live(&mut s, seq, pl, &mut log);
    serve(&mut s, &q, &mut log);
    assert_eq!(log.resets, [ResetReason::Restarted]);
    let tail: Vec<(i64, bool)> = log.delivered[5..].to_vec();
    assert_eq!(tail, [(0, true), (1, true), (2, true)]);
    assert!(s.is_complete());

    // A new process that has already published past our last number: same number, other
    // payload.
    let mut r = Publisher::new(2);
    for _ in 0..3 {
        r.publish();
    }
    s.subscribed();
    assert_eq!(s.wanted(), Some((Purpose::Reconnect, 2)));
    serve(&mut s, &r, &mut log);
    assert_eq!(log.resets, [ResetReason::Restarted, ResetReason::Restarted]);
    assert_eq!(log.delivered.len(), 11);
}

#[test]
fn a_reconnect_catches_up_on_what_was_published_meanwhile() {
    let mut p = Publisher::new(0);
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    let (seq, pl) = p.publish();
    live(&mut s, seq, pl, &mut log);
    p.publish();
    p.publish();
    s.subscribed();
    serve(&mut s, &p, &mut log);
    assert_eq!(log.delivered, [(0, false), (1, true), (2, true)]);
    assert!(log.resets.is_empty() && s.is_complete());
}

#[test]
fn replays_that_cannot_be_had() {
    let fail = |s: &mut Stream, log: &mut Seen| {
        s.sent();
        let mut out = Vec::new();
        s.failed("timed out".into(), &mut out);
        seen(&out, log);
    };
    // Start-up: the stream is taken as it comes.
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    fail(&mut s, &mut log);
    assert!(s.is_complete() && log.resets.is_empty());
    live(&mut s, 4, payload(0, 4), &mut log);
    // Gap: reset, go on from the batch at hand.
    live(&mut s, 9, payload(0, 9), &mut log);
    fail(&mut s, &mut log);
    assert_eq!(log.resets, [ResetReason::Gap]);
    assert_eq!(log.delivered, [(4, false), (9, false)]);
    // Reconnect: nothing changes.
    s.subscribed();
    fail(&mut s, &mut log);
    assert_eq!(log.resets.len(), 1);
    // Going back: reset as restarted.
    live(&mut s, 3, payload(1, 3), &mut log);
    fail(&mut s, &mut log);
    assert_eq!(log.resets, [ResetReason::Gap, ResetReason::Restarted]);
    assert_eq!(log.delivered.last(), Some(&(3, false)));
    assert!(s.is_complete());
    // A replay socket that cannot even be reached fails the same way.
    s.subscribed();
    let mut out = Vec::new();
    s.failed("connection refused".into(), &mut out);
    seen(&out, &mut log);
    assert!(s.wanted().is_none() && !s.is_replaying());
    assert_eq!(log.failed.len(), 5);
}

#[test]
fn a_reply_missing_mid_stream_is_asked_again_then_given_up() {
    let mut p = Publisher::new(0);
    for _ in 0..5 {
        p.publish();
    }
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    s.sent();
    let mut out = Vec::new();
    for r in p
        .answer(0)
        .into_iter()
        .filter(|r| !matches!(r, Reply::Batch { seq: 2, .. }))
    {
        s.reply(r, &mut out);
        if s.wanted().is_some() {
            break;
        }
    }
    seen(&out, &mut log);
    assert_eq!(log.failed.len(), 1);
    assert_eq!(
        s.wanted(),
        Some((Purpose::Warm, 1)),
        "again from the last delivered"
    );
    serve(&mut s, &p, &mut log);
    let order: Vec<i64> = log.delivered.iter().map(|d| d.0).collect();
    assert_eq!(order, [0, 1, 2, 3, 4]);
    assert!(s.is_complete());
    // A replay socket that keeps dropping the same reply: given up after a bounded number.
    let mut s = Stream::new(true, None, 100);
    s.subscribed();
    let mut log = Seen::default();
    for _ in 0..10 {
        let Some((_, from)) = s.wanted() else { break };
        s.sent();
        let mut out = Vec::new();
        for r in p.answer(from) {
            if matches!(r, Reply::Batch { seq: 2, .. }) {
                continue;
            }
            s.reply(r, &mut out);
            if s.wanted().is_some() || !s.is_replaying() {
                break;
            }
        }
        seen(&out, &mut log);
    }
    assert_eq!(log.failed.len(), MAX_ATTEMPTS as usize);
    assert!(!s.is_replaying() && s.is_complete());
}

#[test]
fn unreadable_batches_reset_and_the_stream_goes_on() {
    let mut s = Stream::new(false, None, 100);
    let mut log = Seen::default();
    live(&mut s, 0, payload(0, 0), &mut log);
    live(&mut s, 1, Bytes::from_static(b"\xc1garbage"), &mut log);
    live(&mut s, 2, payload(0, 2), &mut log);
    assert_eq!(log.resets, [ResetReason::Unreadable]);
    assert_eq!(log.malformed, 1);
    assert_eq!(log.delivered, [(0, false), (2, false)]);
}

#[test]
fn resume_continues_after_a_siblings_watermark() {
    let mut p = Publisher::new(0);
    for _ in 0..6 {
        p.publish();
    }
    let mut s = Stream::new(true, Some(3), 100);
    s.subscribed();
    assert_eq!(s.last(), Some(3));
    assert_eq!(s.wanted(), Some((Purpose::Resume, 4)));
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    assert_eq!(log.delivered, [(4, true), (5, true)]);
    assert!(s.is_complete() && log.resets.is_empty());
    // A buffer that no longer reaches back to the watermark: reset, rebuild.
    p.keep = 2;
    p.publish();
    p.buffer.drain(..p.buffer.len() - 2);
    let mut s = Stream::new(true, Some(1), 100);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    assert_eq!(log.resets, [ResetReason::Gap]);
    assert_eq!(log.delivered, [(5, true), (6, true)]);
}

#[test]
fn a_replay_holding_more_than_its_cap_fails() {
    let mut p = Publisher::new(0);
    for _ in 0..20 {
        p.publish();
    }
    let mut s = Stream::new(true, None, 5);
    s.subscribed();
    let mut log = Seen::default();
    serve(&mut s, &p, &mut log);
    assert_eq!(log.delivered.len(), 5);
    assert_eq!(log.failed.len(), 1);
    assert!(s.is_complete());
}

proptest! {
    /// A publisher streaming batches with live losses, reconnects, bad messages (numbers far
    /// ahead and back) and a replay buffer holding everything: every batch is delivered exactly
    /// once, in order, with no reset.
    #[test]
    fn losses_reconnects_and_bad_messages_never_cost_a_batch(
        ops in proptest::collection::vec(0u8..10, 1..200),
    ) {
        let mut p = Publisher::new(0);
        let mut s = Stream::new(true, None, 100_000);
        s.subscribed();
        let mut log = Seen::default();
        serve(&mut s, &p, &mut log);
        for op in ops {
            match op {
                0 => { p.publish(); } // lost on the way
                1 => s.subscribed(),
                2 if !s.is_replaying() => live(&mut s, p.next + 1_000, payload(9, 0), &mut log),
                2 => {}
                3 => {
                    // A number going back (one claiming exactly the next number cannot be
                    // told from the real one without a replay per message).
                    if let Some(back) = s.last().map(|l| l - 2).filter(|&b| b >= 0) {
                        if !s.is_replaying() {
                            live(&mut s, back, payload(9, back), &mut log);
                        }
                    }
                }
                _ => {
                    let (seq, pl) = p.publish();
                    if !s.is_replaying() {
                        live(&mut s, seq, pl, &mut log);
                    }
                }
            }
            serve(&mut s, &p, &mut log);
        }
        // Whatever is still missing comes with the next batch.
        let (seq, pl) = p.publish();
        live(&mut s, seq, pl, &mut log);
        serve(&mut s, &p, &mut log);
        let order: Vec<i64> = log.delivered.iter().map(|d| d.0).collect();
        prop_assert_eq!(order, (0..p.next).collect::<Vec<_>>());
        prop_assert!(log.resets.is_empty(), "{:?}", log.resets);
        prop_assert!(s.is_complete());
    }
}

proptest! {
    /// Numbers a hostile or broken publisher may send, at the edges of i64, live and in replay
    /// replies, never overflow (debug builds panic on overflow) and never leave the stream
    /// wanting a replay forever.
    #[test]
    fn sequence_numbers_at_the_edges_of_i64_never_overflow(
        ops in proptest::collection::vec(
            (0u8..4, prop_oneof![
                Just(i64::MAX), Just(i64::MAX - 1), Just(i64::MIN), Just(i64::MIN + 1),
                Just(-1i64), Just(0i64), any::<i64>(),
            ]),
            1..60,
        ),
    ) {
        let mut s = Stream::new(true, None, 1_000);
        s.subscribed();
        let mut log = Seen::default();
        for (op, seq) in ops {
            let mut out = Vec::new();
            match op {
                // The driver reads live messages only while no replay runs.
                0 | 1 if !s.is_replaying() => s.live(seq, payload(0, seq), &mut out),
                0 | 1 => {}
                2 => {
                    if s.wanted().is_some() {
                        s.sent();
                    }
                    s.reply(Reply::Batch { seq, payload: payload(0, seq) }, &mut out);
                }
                _ => s.reply(Reply::End, &mut out),
            }
            seen(&out, &mut log);
        }
        // The stream still works: an honest replay of what it asks settles.
        let mut rounds = 0;
        while s.wanted().is_some() && rounds < 20 {
            rounds += 1;
            s.sent();
            let mut out = Vec::new();
            s.reply(Reply::End, &mut out);
        }
        prop_assert!(s.wanted().is_none(), "still wanting after {rounds} answers");
    }
}

#[test]
fn fingerprints_tell_batches_apart_in_constant_time() {
    let big = vec![7u8; 32 << 20];
    let mut other = big.clone();
    other[3] = 8; // another timestamp
    let mut longer = big.clone();
    longer.push(7);
    assert_eq!(fingerprint(&big), fingerprint(&big.clone()));
    assert_ne!(fingerprint(&big), fingerprint(&other));
    assert_ne!(fingerprint(&big), fingerprint(&longer));
    assert_ne!(fingerprint(b"small a"), fingerprint(b"small b"));
    // 32 MiB fingerprinted a thousand times in well under the time one hash of it all would
    // take per call (a hostile publisher's max-size messages cost their reading only).
    let t = std::time::Instant::now();
    for _ in 0..1000 {
        std::hint::black_box(fingerprint(std::hint::black_box(&big)));
    }
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
}

/// A vLLM batch of one event per `(kind, hash, group)`: a map-form store ("S") of one block
/// from the root or a removal ("R").
fn grouped(events: &[(&str, u64, u64)]) -> Bytes {
    use rmp::encode as w;
    let mut o = Vec::new();
    w::write_array_len(&mut o, 2).unwrap();
    w::write_f64(&mut o, 1.0).unwrap();
    w::write_array_len(&mut o, events.len() as u32).unwrap();
    for &(kind, hash, group) in events {
        let store = kind == "S";
        w::write_map_len(&mut o, if store { 6 } else { 3 }).unwrap();
        w::write_str(&mut o, "type").unwrap();
        w::write_str(&mut o, if store { "BlockStored" } else { "BlockRemoved" }).unwrap();
        w::write_str(&mut o, "block_hashes").unwrap();
        w::write_array_len(&mut o, 1).unwrap();
        w::write_uint(&mut o, hash).unwrap();
        if store {
            w::write_str(&mut o, "parent_block_hash").unwrap();
            w::write_nil(&mut o).unwrap();
            w::write_str(&mut o, "token_ids").unwrap();
            w::write_array_len(&mut o, 4).unwrap();
            for _ in 0..4 {
                w::write_uint(&mut o, 7).unwrap();
            }
            w::write_str(&mut o, "block_size").unwrap();
            w::write_uint(&mut o, 4).unwrap();
        }
        w::write_str(&mut o, "group_idx").unwrap();
        w::write_uint(&mut o, group).unwrap();
    }
    Bytes::from(o)
}

fn removals(steps: &[Step]) -> usize {
    steps
        .iter()
        .map(|s| match s {
            Step::Deliver { batch, .. } => batch
                .events
                .iter()
                .filter(|e| matches!(e, crate::kv::wire::KvEvent::BlockRemoved(_)))
                .count(),
            _ => 0,
        })
        .sum()
}

/// Which KV-cache groups hold a block is followed from batch to batch of one publisher, and
/// forgotten with its blocks when it is reset (what the index holds then starts over).
#[test]
fn kv_cache_groups_are_followed_across_batches_and_forgotten_on_a_reset() {
    let mut s = Stream::new(false, None, 100);
    s.subscribed();
    let mut out = Vec::new();
    s.live(
        0,
        grouped(&[("S", 8, 0), ("S", 8, 1), ("S", 9, 0), ("S", 9, 1)]),
        &mut out,
    );
    s.live(1, grouped(&[("R", 8, 0)]), &mut out);
    assert_eq!(removals(&out), 0, "group 1 still holds it");
    // A gap without a replay resets the publisher: its groups are forgotten with its blocks,
    // so a removal of a block this copy no longer tracks is applied as it comes.
    out.clear();
    s.live(5, grouped(&[("R", 9, 0)]), &mut out);
    assert!(out
        .iter()
        .any(|s| matches!(s, Step::Reset(ResetReason::Gap))));
    assert_eq!(removals(&out), 1);
}
