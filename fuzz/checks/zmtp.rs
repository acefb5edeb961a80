//! The ZMTP client codec (`src/kv/zmtp.rs`) on arbitrary bytes, as a publisher or a replay
//! socket could send them: it must never panic, never hold more than its caps of an unfinished
//! message, never return a message over them, and give the same items however the bytes are
//! split into reads.
//!
//! Input layout: byte 0 picks the socket type (even: SUB, odd: DEALER) and, with byte 1, where
//! the rest is cut in two reads; a valid greeting and READY are put in front half the time (by
//! byte 0's bit 1) so the traffic phase is reached.
//!
//! Shared by the `zmtp` fuzz target and `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`: one copy of the checks, so a stored input is held to exactly what the
//! fuzzer holds it to.

use bytes::BytesMut;
use radixgate::kv::zmtp::{Decoder, Item, Limits, SocketType};

const LIMITS: Limits = Limits {
    max_frames: 4,
    max_message_bytes: 4096,
    max_command_bytes: 512,
};

fn peer_opening(kind: SocketType) -> Vec<u8> {
    let mut b = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
    b.extend_from_slice(b"NULL");
    b.resize(64, 0);
    let peer: &[u8] = match kind {
        SocketType::Sub => b"PUB",
        SocketType::Dealer => b"ROUTER",
    };
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(peer.len() as u32).to_be_bytes());
    body.extend_from_slice(peer);
    b.extend_from_slice(&[0x04, body.len() as u8]);
    b.extend_from_slice(&body);
    b
}

/// The items a decoder gives for `reads` fed in turn, and whether it stopped on an error.
fn decode_reads(kind: SocketType, reads: &[&[u8]]) -> (Vec<Item>, bool) {
    let mut d = Decoder::new(kind, LIMITS);
    let mut buf = BytesMut::new();
    let mut items = Vec::new();
    for r in reads {
        buf.extend_from_slice(r);
        loop {
            match d.decode(&mut buf) {
                Ok(Some(item)) => {
                    if let Item::Message(frames) = &item {
                        assert!(frames.len() <= LIMITS.max_frames);
                        let total: usize = frames.iter().map(|f| f.len()).sum();
                        assert!(total <= LIMITS.max_message_bytes);
                    }
                    items.push(item);
                }
                Ok(None) => break,
                Err(_) => return (items, true),
            }
            assert!(d.held_bytes() <= LIMITS.max_message_bytes as u64);
        }
    }
    (items, false)
}

/// Runs the checks on one input; panics where the fuzzer would report a crash.
pub fn run(data: &[u8]) {
    let (Some(&a), Some(&b)) = (data.first(), data.get(1)) else {
        return;
    };
    let kind = if a & 1 == 0 {
        SocketType::Sub
    } else {
        SocketType::Dealer
    };
    let mut input = if a & 2 != 0 {
        peer_opening(kind)
    } else {
        Vec::new()
    };
    input.extend_from_slice(&data[2..]);
    let whole = decode_reads(kind, &[&input]);
    let cut = usize::from(b) * input.len() / 256;
    let (x, y) = input.split_at(cut);
    let split = decode_reads(kind, &[x, y]);
    assert_eq!(whole, split, "items depend on how the bytes were read");
}
