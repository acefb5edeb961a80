//! The client half of ZMTP 3.0 (ZeroMQ's wire protocol, RFC 23) with the NULL mechanism: what a
//! SUB socket needs to read a publisher's events and a DEALER needs to ask its replay socket.
//! Pure: bytes in, frames out, no I/O (`kv::socket` drives it over TCP; a fuzz target feeds it
//! arbitrary bytes).
//!
//! Why our own and not libzmq: libzmq counts a high-water mark in whole messages and buffers a
//! multipart message until its last frame, so a peer sending one endless message (frame after
//! frame, each under `ZMQ_MAXMSGSIZE`) grows the subscriber's memory without bound, and name
//! resolution runs on its only I/O thread. Reading the frames ourselves caps everything where
//! the bytes arrive: frames per message, bytes per frame and per message, bytes per command.
//!
//! The exchange:
//! 1. [`hello`], sent at once: the 64-byte greeting (signature `FF 00*7 01 7F`, version 3.0,
//!    mechanism `NULL`, as-server 0, filler) and a `READY` command whose metadata names our
//!    socket type (`Socket-Type: SUB` or `DEALER`); the peer's greeting must be ZMTP 3.x with
//!    the NULL mechanism, its `READY` must name a type that may talk to ours (PUB/XPUB,
//!    ROUTER);
//! 2. only once the peer's `READY` has arrived, messages: for a SUB first [`subscribe_all`]
//!    (the 3.0 form: a message whose first byte is 1). libzmq drops a connection whose first
//!    message arrives before it has sent its own `READY` (measured: greeting, READY and the
//!    subscription in one write are refused; the subscription sent after the peer's READY is
//!    taken).
//!
//! Frames: a flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND), a size (1 byte, or 8 bytes
//! big-endian when LONG), the body. Commands are single frames between messages; a `PING` is
//! answered with a `PONG` (ZMTP 3.1 heartbeats, harmless to support), other commands are
//! ignored, an `ERROR` ends the connection.

use bytes::{Buf, Bytes, BytesMut};

/// Bytes of a greeting.
pub const GREETING_LEN: usize = 64;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Which socket this side plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to a publisher's live stream.
    Sub,
    /// Asks a replay ROUTER for buffered batches.
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// Whether a peer of type `peer` may talk to this socket (RFC 23's compatibility table,
    /// narrowed to the peers a KV-event publisher runs).
    fn accepts(self, peer: &[u8]) -> bool {
        let is = |n: &[u8]| peer.eq_ignore_ascii_case(n);
        match self {
            SocketType::Sub => is(b"PUB") || is(b"XPUB"),
            SocketType::Dealer => is(b"ROUTER"),
        }
    }
}

/// What one connection may make this side hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Frames in one message (a live event message has 3, a replay reply 4).
    pub max_frames: usize,
    /// Bytes in one frame, and in one whole message.
    pub max_message_bytes: usize,
    /// Bytes of one command frame (READY metadata, PING context).
    pub max_command_bytes: usize,
}

/// Why a connection's bytes were refused (the connection is then closed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZmtpError {
    /// Not a ZMTP 3 greeting (or not the NULL mechanism).
    Greeting(&'static str),
    /// The peer's first command is not READY, or READY is malformed.
    Handshake(&'static str),
    /// The peer is a socket type ours cannot talk to.
    SocketType(String),
    /// The peer sent an ERROR command.
    PeerError(String),
    /// More frames in one message than [`Limits::max_frames`].
    TooManyFrames(usize),
    /// A frame or message over [`Limits::max_message_bytes`], or a command over
    /// [`Limits::max_command_bytes`].
    TooLarge(u64),
    /// A command frame inside a multipart message.
    CommandInMessage,
}

impl std::fmt::Display for ZmtpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ZmtpError::Greeting(why) => write!(f, "bad ZMTP greeting: {why}"),
            ZmtpError::Handshake(why) => write!(f, "bad ZMTP handshake: {why}"),
            ZmtpError::SocketType(t) => write!(f, "peer socket type {t} cannot talk to ours"),
            ZmtpError::PeerError(why) => write!(f, "peer refused the connection: {why}"),
            ZmtpError::TooManyFrames(n) => write!(f, "a message of more than {n} frames"),
            ZmtpError::TooLarge(n) => write!(f, "a frame or message of {n} bytes, over the cap"),
            ZmtpError::CommandInMessage => f.write_str("a command inside a multipart message"),
        }
    }
}

impl std::error::Error for ZmtpError {}

/// What the decoder produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// The handshake is done: messages may be sent and will arrive.
    Ready,
    /// One whole message, its frames in order.
    Message(Vec<Bytes>),
    /// A PING: send [`pong`] with this context.
    Ping(Bytes),
}

/// The bytes this side opens with: greeting and READY.
pub fn hello(kind: SocketType) -> Vec<u8> {
    let mut out = Vec::with_capacity(GREETING_LEN + 32);
    let mut greeting = [0u8; GREETING_LEN];
    greeting[0] = 0xFF;
    greeting[8] = 0x01;
    greeting[9] = 0x7F;
    greeting[10] = 3;
    greeting[11] = 0;
    greeting[12..16].copy_from_slice(b"NULL");
    out.extend_from_slice(&greeting);
    let mut ready = Vec::with_capacity(32);
    ready.push(5);
    ready.extend_from_slice(b"READY");
    let name = b"Socket-Type";
    ready.push(name.len() as u8);
    ready.extend_from_slice(name);
    ready.extend_from_slice(&(kind.name().len() as u32).to_be_bytes());
    ready.extend_from_slice(kind.name());
    frame(COMMAND, &ready, &mut out);
    out
}

/// A SUB's subscription to every topic (send after the peer's READY): one message of one frame.
pub const SUBSCRIBE_ALL: [&[u8]; 1] = [&[1]];

/// Append a SUB's subscription to every topic ([`SUBSCRIBE_ALL`]) to `out`.
pub fn subscribe_all(out: &mut Vec<u8>) {
    encode_message(&SUBSCRIBE_ALL, out);
}

/// Bytes [`encode_message`] appends for `frames` (a sender checks its cap before encoding).
pub fn message_len(frames: &[&[u8]]) -> usize {
    frames.iter().map(|f| frame_len(f.len())).sum()
}

fn frame_len(body: usize) -> usize {
    body + if body > 255 { 9 } else { 2 }
}

/// Append one message (`frames` in order, MORE on all but the last) to `out`.
pub fn encode_message(frames: &[&[u8]], out: &mut Vec<u8>) {
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        frame(more, f, out);
    }
}

/// The PONG answering a PING with `context`.
pub fn pong(context: &[u8], out: &mut Vec<u8>) {
    let mut body = Vec::with_capacity(5 + context.len());
    body.push(4);
    body.extend_from_slice(b"PONG");
    body.extend_from_slice(context);
    frame(COMMAND, &body, out);
}

fn frame(flags: u8, body: &[u8], out: &mut Vec<u8>) {
    if body.len() > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Handshake,
    Traffic,
}

/// The receiving half of one connection: feed it the bytes read, take items out.
#[derive(Debug)]
pub struct Decoder {
    kind: SocketType,
    limits: Limits,
    phase: Phase,
    /// Frames of the message being received.
    frames: Vec<Bytes>,
    message_bytes: u64,
}

/// A frame header as read: its flags, body size, and header length.
struct Header {
    flags: u8,
    size: u64,
    len: usize,
}

fn header(buf: &[u8]) -> Option<Header> {
    let &flags = buf.first()?;
    if flags & LONG != 0 {
        let size: [u8; 8] = buf.get(1..9)?.try_into().ok()?;
        Some(Header {
            flags,
            size: u64::from_be_bytes(size),
            len: 9,
        })
    } else {
        Some(Header {
            flags,
            size: u64::from(*buf.get(1)?),
            len: 2,
        })
    }
}

impl Decoder {
    /// A decoder for a connection of our `kind`, held to `limits`.
    pub fn new(kind: SocketType, limits: Limits) -> Decoder {
        Decoder {
            kind,
            limits,
            phase: Phase::Greeting,
            frames: Vec::new(),
            message_bytes: 0,
        }
    }

    /// Whether the handshake is done.
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// Whether a message has started but not ended (its frames are held here).
    pub fn in_message(&self) -> bool {
        !self.frames.is_empty()
    }

    /// Bytes this decoder holds of an unfinished message.
    pub fn held_bytes(&self) -> u64 {
        self.message_bytes
    }

    /// The bytes `buf` must hold for the message frame it starts with to be taken whole (its
    /// header included), once that header is here and within the caps; `None` otherwise. The
    /// reader makes room for all of it at once instead of growing its buffer read by read.
    pub fn awaiting(&self, buf: &[u8]) -> Option<usize> {
        if self.phase != Phase::Traffic {
            return None;
        }
        let h = header(buf)?;
        let max = self.limits.max_message_bytes as u64;
        if h.flags & COMMAND != 0 || h.size > max || self.message_bytes.saturating_add(h.size) > max
        {
            return None;
        }
        Some(h.len + h.size as usize)
    }

    /// Take the next item out of `buf` (consuming its bytes), `Ok(None)` when `buf` does not
    /// hold one whole item yet. Checks every size before the bytes it announces are awaited,
    /// so a refused frame never has to arrive.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, ZmtpError> {
        loop {
            match self.phase {
                Phase::Greeting => {
                    if buf.len() < GREETING_LEN {
                        // Fail as early as the bytes allow (a peer that is not ZMTP at all).
                        if buf.first().is_some_and(|&b| b != 0xFF) {
                            return Err(ZmtpError::Greeting("no signature"));
                        }
                        return Ok(None);
                    }
                    let g = buf.split_to(GREETING_LEN);
                    check_greeting(&g)?;
                    self.phase = Phase::Handshake;
                }
                Phase::Handshake => {
                    let Some(body) = self.command(buf)? else {
                        return Ok(None);
                    };
                    self.handshake(&body)?;
                    self.phase = Phase::Traffic;
                    return Ok(Some(Item::Ready));
                }
                Phase::Traffic => return self.traffic(buf),
            }
        }
    }

    /// One whole command frame's body (the handshake), or `None` until it has arrived.
    fn command(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, ZmtpError> {
        let Some(h) = header(buf) else {
            return Ok(None);
        };
        if h.flags & COMMAND == 0 {
            return Err(ZmtpError::Handshake("a message before READY"));
        }
        if h.size > self.limits.max_command_bytes as u64 {
            return Err(ZmtpError::TooLarge(h.size));
        }
        let total = h.len + h.size as usize;
        if buf.len() < total {
            return Ok(None);
        }
        buf.advance(h.len);
        Ok(Some(buf.split_to(h.size as usize).freeze()))
    }

    fn handshake(&self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, rest) = command_name(body)?;
        if name.eq_ignore_ascii_case(b"ERROR") {
            let reason = rest.get(1..).unwrap_or_default();
            return Err(ZmtpError::PeerError(shown(reason)));
        }
        if !name.eq_ignore_ascii_case(b"READY") {
            return Err(ZmtpError::Handshake("first command is not READY"));
        }
        let mut props = rest;
        let mut peer_type = None;
        while !props.is_empty() {
            let n = usize::from(props[0]);
            let key = props
                .get(1..1 + n)
                .ok_or(ZmtpError::Handshake("property name"))?;
            let len_at = 1 + n;
            let len: [u8; 4] = props
                .get(len_at..len_at + 4)
                .and_then(|b| b.try_into().ok())
                .ok_or(ZmtpError::Handshake("property length"))?;
            let len = u32::from_be_bytes(len) as usize;
            let value = props
                .get(len_at + 4..len_at + 4 + len)
                .ok_or(ZmtpError::Handshake("property value"))?;
            if key.eq_ignore_ascii_case(b"Socket-Type") {
                peer_type = Some(value);
            }
            props = &props[len_at + 4 + len..];
        }
        let peer = peer_type.ok_or(ZmtpError::Handshake("READY without Socket-Type"))?;
        if !self.kind.accepts(peer) {
            return Err(ZmtpError::SocketType(shown(peer)));
        }
        Ok(())
    }

    fn traffic(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, ZmtpError> {
        loop {
            let Some(h) = header(buf) else {
                return Ok(None);
            };
            if h.flags & COMMAND != 0 {
                if self.in_message() {
                    return Err(ZmtpError::CommandInMessage);
                }
                let Some(body) = self.command(buf)? else {
                    return Ok(None);
                };
                let (name, rest) = command_name(&body)?;
                if name.eq_ignore_ascii_case(b"PING") {
                    // PING = TTL (2 bytes) + context (at most 16 bytes).
                    let start = (body.len() - rest.len() + 2).min(body.len());
                    let ctx = body.slice(start..(start + 16).min(body.len()));
                    return Ok(Some(Item::Ping(ctx)));
                }
                if name.eq_ignore_ascii_case(b"ERROR") {
                    return Err(ZmtpError::PeerError(shown(
                        rest.get(1..).unwrap_or_default(),
                    )));
                }
                continue; // PONG, SUBSCRIBE and anything newer: nothing for a client to do.
            }
            let max = self.limits.max_message_bytes as u64;
            let total = self.message_bytes.saturating_add(h.size);
            if h.size > max || total > max {
                return Err(ZmtpError::TooLarge(total));
            }
            if self.frames.len() >= self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
            }
            let need = h.len + h.size as usize;
            if buf.len() < need {
                return Ok(None);
            }
            buf.advance(h.len);
            self.frames.push(buf.split_to(h.size as usize).freeze());
            self.message_bytes = total;
            if h.flags & MORE == 0 {
                self.message_bytes = 0;
                return Ok(Some(Item::Message(std::mem::take(&mut self.frames))));
            }
        }
    }
}

fn check_greeting(g: &[u8]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] & 0x01 == 0 {
        return Err(ZmtpError::Greeting("no signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting("ZMTP before 3.0"));
    }
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Greeting("not the NULL mechanism"));
    }
    Ok(())
}

/// A command body's name and what follows it.
fn command_name(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let n = usize::from(*body.first().ok_or(ZmtpError::Handshake("empty command"))?);
    let name = body
        .get(1..1 + n)
        .ok_or(ZmtpError::Handshake("command name"))?;
    Ok((name, &body[1 + n..]))
}

/// Peer-supplied bytes for a log line: printable ASCII only, at most 64 of them.
fn shown(b: &[u8]) -> String {
    b.iter()
        .take(64)
        .map(|&c| {
            if c.is_ascii_graphic() || c == b' ' {
                c as char
            } else {
                '?'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
