//! The codec against byte strings written out by hand from RFC 23 (not by the encoder under
//! test), fed whole, byte by byte and in random splits.

use super::*;
use proptest::prelude::*;

const LIMITS: Limits = Limits {
    max_frames: 4,
    max_message_bytes: 1 << 16,
    max_command_bytes: 1024,
};

/// A publisher's greeting as libzmq 4.3 sends it: ZMTP 3.1, NULL, as-server 0.
fn peer_greeting() -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
    g.extend_from_slice(b"NULL");
    g.resize(64, 0);
    g
}

/// A READY command naming `socket_type` (and an Identity property before it, as a ROUTER sends).
fn peer_ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    for (k, v) in [("Identity", ""), ("socket-type", socket_type)] {
        body.push(k.len() as u8);
        body.extend_from_slice(k.as_bytes());
        body.extend_from_slice(&(v.len() as u32).to_be_bytes());
        body.extend_from_slice(v.as_bytes());
    }
    let mut out = vec![0x04, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

fn short(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![flags, body.len() as u8];
    out.extend_from_slice(body);
    out
}

fn long(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![flags | 0x02];
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn drain(d: &mut Decoder, buf: &mut BytesMut) -> Result<Vec<Item>, ZmtpError> {
    let mut out = Vec::new();
    while let Some(item) = d.decode(buf)? {
        out.push(item);
    }
    Ok(out)
}

/// A publisher's opening plus one 3-frame event message (the payload long-framed).
fn publisher_stream() -> (Vec<u8>, Vec<Bytes>) {
    let payload = vec![0xAB; 300];
    let mut bytes = peer_greeting();
    bytes.extend(peer_ready("PUB"));
    bytes.extend(short(0x01, b"topic"));
    bytes.extend(short(0x01, &7u64.to_be_bytes()));
    bytes.extend(long(0x00, &payload));
    let frames = vec![
        Bytes::from_static(b"topic"),
        Bytes::copy_from_slice(&7u64.to_be_bytes()),
        Bytes::from(payload),
    ];
    (bytes, frames)
}

#[test]
fn hello_is_the_rfc_greeting_ready_and_subscription() {
    let h = hello(SocketType::Sub);
    assert_eq!(&h[..10], &[0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F]);
    assert_eq!(&h[10..12], &[3, 0], "ZMTP 3.0");
    assert_eq!(&h[12..16], b"NULL");
    assert!(
        h[16..64].iter().all(|&b| b == 0),
        "as-server 0, zero filler"
    );
    let ready = &h[64..];
    assert_eq!(ready[0], 0x04, "a short command frame");
    let n = usize::from(ready[1]);
    let body = &ready[2..2 + n];
    assert_eq!(body, b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
    assert_eq!(
        ready.len(),
        2 + n,
        "nothing after READY until the peer's READY"
    );
    let mut sub = Vec::new();
    subscribe_all(&mut sub);
    assert_eq!(sub, [0x00, 0x01, 0x01], "subscribe to every topic");
    let d = hello(SocketType::Dealer);
    assert!(d.ends_with(b"\x00\x00\x00\x06DEALER"));
}

#[test]
fn a_publisher_stream_decodes_whole_and_byte_by_byte() {
    let (bytes, frames) = publisher_stream();
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(
        drain(&mut d, &mut buf).unwrap(),
        vec![Item::Ready, Item::Message(frames.clone())]
    );
    assert!(buf.is_empty());
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    let mut buf = BytesMut::new();
    let mut items = Vec::new();
    for &b in &bytes {
        buf.extend_from_slice(&[b]);
        items.extend(drain(&mut d, &mut buf).unwrap());
    }
    assert_eq!(items, vec![Item::Ready, Item::Message(frames)]);
}

#[test]
fn peers_that_cannot_talk_to_us_are_refused() {
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\n"[..]);
    assert_eq!(d.decode(&mut buf), Err(ZmtpError::Greeting("no signature")));
    let mut g = peer_greeting();
    g[10] = 2;
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert!(matches!(
        d.decode(&mut BytesMut::from(&g[..])),
        Err(ZmtpError::Greeting(_))
    ));
    let mut g = peer_greeting();
    g[12..17].copy_from_slice(b"CURVE");
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert!(matches!(
        d.decode(&mut BytesMut::from(&g[..])),
        Err(ZmtpError::Greeting(_))
    ));
    for (kind, peer) in [(SocketType::Sub, "ROUTER"), (SocketType::Dealer, "PUB")] {
        let mut bytes = peer_greeting();
        bytes.extend(peer_ready(peer));
        let mut d = Decoder::new(kind, LIMITS);
        assert_eq!(
            drain(&mut d, &mut BytesMut::from(&bytes[..])),
            Err(ZmtpError::SocketType(peer.into()))
        );
    }
    // An ERROR instead of READY.
    let mut bytes = peer_greeting();
    bytes.extend(short(0x04, b"\x05ERROR\x07go away"));
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert_eq!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::PeerError("go away".into()))
    );
    // A message before READY.
    let mut bytes = peer_greeting();
    bytes.extend(short(0x00, b"x"));
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert!(matches!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::Handshake(_))
    ));
}

#[test]
fn caps_are_enforced_on_the_header_before_the_body_arrives() {
    let mut open = peer_greeting();
    open.extend(peer_ready("PUB"));
    // A frame announcing 1 GiB: refused with nothing but its 9-byte header in hand.
    let mut bytes = open.clone();
    bytes.push(0x02);
    bytes.extend_from_slice(&(1u64 << 30).to_be_bytes());
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    let mut buf = BytesMut::from(&bytes[..]);
    assert_eq!(d.decode(&mut buf), Ok(Some(Item::Ready)));
    assert_eq!(d.decode(&mut buf), Err(ZmtpError::TooLarge(1 << 30)));
    // An endless multipart message: the fifth frame is refused.
    let mut bytes = open.clone();
    for _ in 0..5 {
        bytes.extend(short(0x01, b"frame"));
    }
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert_eq!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::TooManyFrames(4))
    );
    // Frames each under the cap whose sum is over it.
    let mut bytes = open.clone();
    let big = vec![0u8; 40_000];
    bytes.extend(long(0x01, &big));
    bytes.extend(long(0x00, &big));
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert_eq!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::TooLarge(80_000))
    );
    // A command over its cap.
    let mut bytes = open;
    bytes.extend(long(0x04, &vec![4u8; 2000]));
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert_eq!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::TooLarge(2000))
    );
}

#[test]
fn ping_is_answered_other_commands_skipped_commands_inside_a_message_refused() {
    let mut bytes = peer_greeting();
    bytes.extend(peer_ready("ROUTER"));
    bytes.extend(short(0x04, b"\x04PING\x00\x0aCTX"));
    bytes.extend(short(0x04, b"\x04PONG"));
    bytes.extend(short(0x01, b""));
    bytes.extend(short(0x00, b"reply"));
    let mut d = Decoder::new(SocketType::Dealer, LIMITS);
    let items = drain(&mut d, &mut BytesMut::from(&bytes[..])).unwrap();
    assert_eq!(
        items,
        vec![
            Item::Ready,
            Item::Ping(Bytes::from_static(b"CTX")),
            Item::Message(vec![Bytes::new(), Bytes::from_static(b"reply")]),
        ]
    );
    let mut out = Vec::new();
    pong(b"CTX", &mut out);
    assert_eq!(out, b"\x04\x08\x04PONGCTX");
    let mut bytes = peer_greeting();
    bytes.extend(peer_ready("PUB"));
    bytes.extend(short(0x01, b"a"));
    bytes.extend(short(0x04, b"\x04PING\x00\x00"));
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    assert_eq!(
        drain(&mut d, &mut BytesMut::from(&bytes[..])),
        Err(ZmtpError::CommandInMessage)
    );
}

#[test]
fn encoded_messages_use_short_and_long_frames() {
    let mut out = Vec::new();
    encode_message(&[b"", &[0u8; 8], &[7u8; 256]], &mut out);
    assert_eq!(&out[..2], &[0x01, 0x00]);
    assert_eq!(&out[2..4], &[0x01, 0x08]);
    assert_eq!(
        out[12], 0x02,
        "a 256-byte body needs the long form, last frame"
    );
    assert_eq!(&out[13..21], &256u64.to_be_bytes());
    assert_eq!(out.len(), 21 + 256);
    assert_eq!(message_len(&[b"", &[0u8; 8], &[7u8; 256]]), out.len());
    assert_eq!(
        message_len(&[&[7u8; 255]]),
        2 + 255,
        "255 bytes: still the short form"
    );
    assert_eq!(message_len(&SUBSCRIBE_ALL), 3);
}

#[test]
fn awaiting_names_a_message_frames_size_only_once_its_header_passed_the_caps() {
    let mut d = Decoder::new(SocketType::Sub, LIMITS);
    // Before the handshake: nothing is awaited.
    assert_eq!(d.awaiting(&long(0, &[0; 300])[..9]), None);
    let mut buf = BytesMut::from(&[peer_greeting(), peer_ready("PUB")].concat()[..]);
    assert_eq!(drain(&mut d, &mut buf).unwrap(), vec![Item::Ready]);
    // A header alone: its frame is awaited whole, header included; half a header: not yet.
    let frame = long(0x01, &[7; 40_000]);
    assert_eq!(d.awaiting(&frame[..9]), Some(9 + 40_000));
    assert_eq!(d.awaiting(&frame[..5]), None);
    assert_eq!(d.awaiting(&short(0, b"ab")[..2]), Some(4));
    // Commands are small and capped apart: not awaited.
    assert_eq!(d.awaiting(&[0x04, 10]), None);
    // A frame over the message cap, or one the message so far leaves no room for: not awaited
    // (decoding refuses it).
    let over = (LIMITS.max_message_bytes as u64 + 1).to_be_bytes();
    assert_eq!(d.awaiting(&[&[0x02][..], &over].concat()), None);
    let mut buf = BytesMut::from(&frame[..]);
    assert_eq!(d.decode(&mut buf), Ok(None));
    let rest = (LIMITS.max_message_bytes as u64 - 40_000 + 1).to_be_bytes();
    assert_eq!(d.awaiting(&[&[0x02][..], &rest].concat()), None);
    assert_eq!(
        d.awaiting(&[&[0x02][..], &(1000u64).to_be_bytes()].concat()),
        Some(1009)
    );
}

proptest! {
    /// Any split of a valid stream yields the same items; arbitrary bytes never panic and never
    /// make the decoder hold more than the caps allow.
    #[test]
    fn splits_agree_and_garbage_is_safe(
        cuts in proptest::collection::vec(0usize..400, 0..8),
        garbage in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let (bytes, frames) = publisher_stream();
        let mut cuts = cuts;
        cuts.push(bytes.len());
        cuts.sort_unstable();
        let mut d = Decoder::new(SocketType::Sub, LIMITS);
        let mut buf = BytesMut::new();
        let mut items = Vec::new();
        let mut at = 0;
        for c in cuts {
            let c = c.min(bytes.len());
            buf.extend_from_slice(&bytes[at..c.max(at)]);
            at = at.max(c);
            items.extend(drain(&mut d, &mut buf).unwrap());
        }
        prop_assert_eq!(items, vec![Item::Ready, Item::Message(frames)]);
        let mut after = BytesMut::from(&garbage[..]);
        while let Ok(Some(_)) = d.decode(&mut after) {}
        prop_assert!(d.held_bytes() <= LIMITS.max_message_bytes as u64);
        let mut fresh = Decoder::new(SocketType::Dealer, LIMITS);
        let _ = drain(&mut fresh, &mut BytesMut::from(&garbage[..]));
    }
}
