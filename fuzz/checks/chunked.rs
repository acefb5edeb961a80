//! Chunked decoding on arbitrary bytes split at arbitrary points. The decoder and the tracker
//! share a state machine and must agree on where the message ends (or that it is malformed);
//! the split must not change the outcome; the decoder must never produce more bytes than it was
//! fed; a small body limit may only turn an outcome into `TooLarge`.
//!
//! Input layout: byte 0 = number of cuts (mod 16), then that many cut bytes, rest = the body.
//!
//! Shared by the `chunked` fuzz target and `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`: one copy of the checks, so a stored input is held to exactly what the
//! fuzzer holds it to.

use bytes::BytesMut;
use radixgate::http::{ChunkError, ChunkTracker, ChunkedDecoder};

/// Where the message ended (`Some(offset)`), `None` when more input is needed, or the error.
type Outcome = Result<Option<usize>, ChunkError>;

fn pieces(input: &[u8], cuts: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) * input.len() / 255)
        .collect();
    points.push(0);
    points.push(input.len());
    points.sort_unstable();
    points.windows(2).map(|w| w[0]..w[1]).collect()
}

fn run_decoder(input: &[u8], ranges: &[std::ops::Range<usize>], max: u64) -> (Outcome, Vec<u8>) {
    let mut d = ChunkedDecoder::new(max);
    let mut out = BytesMut::new();
    for r in ranges {
        match d.feed(&input[r.clone()], &mut out) {
            Err(e) => return (Err(e), out.to_vec()),
            Ok(n) if d.is_done() => {
                assert!(n <= r.len());
                // Done is sticky and consumes nothing more.
                assert_eq!(d.feed(&input[r.start + n..], &mut out), Ok(0));
                return (Ok(Some(r.start + n)), out.to_vec());
            }
            Ok(n) => assert_eq!(n, r.len(), "consumed less without being done"),
        }
    }
    (Ok(None), out.to_vec())
}

fn run_tracker(input: &[u8], ranges: &[std::ops::Range<usize>]) -> Outcome {
    let mut t = ChunkTracker::new();
    for r in ranges {
        if let Some(n) = t.feed(&input[r.clone()])? {
            assert!(n <= r.len());
            return Ok(Some(r.start + n));
        }
    }
    Ok(None)
}

/// Runs the checks on one input; panics where the fuzzer would report a crash.
pub fn run(data: &[u8]) {
    let Some((&ncuts, rest)) = data.split_first() else {
        return;
    };
    let ncuts = usize::from(ncuts % 16).min(rest.len());
    let (cuts, input) = rest.split_at(ncuts);
    let ranges = pieces(input, cuts);
    let whole = pieces(input, &[]);

    let (split_outcome, split_out) = run_decoder(input, &ranges, u64::MAX);
    let (whole_outcome, whole_out) = run_decoder(input, &whole, u64::MAX);
    assert_eq!(split_outcome, whole_outcome, "split changed the outcome");
    assert_eq!(split_out, whole_out, "split changed the decoded bytes");
    assert!(whole_out.len() <= input.len());

    assert_eq!(
        run_tracker(input, &ranges),
        split_outcome,
        "tracker and decoder disagree"
    );
    assert_eq!(run_tracker(input, &whole), split_outcome);

    let (small_outcome, small_out) = run_decoder(input, &ranges, 64);
    assert!(small_out.len() <= 64);
    if small_outcome != split_outcome {
        assert_eq!(small_outcome, Err(ChunkError::TooLarge));
    }
}
