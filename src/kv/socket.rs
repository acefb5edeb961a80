//! One ZMTP connection (`kv::zmtp`) over a nonblocking TCP socket, driven by a reader thread's
//! epoll loop: connect, greet, read whole messages, write requests. Nothing here blocks.
//!
//! **Memory held is bounded where the bytes arrive.** The decoder refuses a frame, a message or
//! a command over its caps from the header alone (the connection is closed before the bytes it
//! announces are read), and every connection's unfinished bytes count against one [`Budget`]
//! shared by all of them. A connection is read while all of them together hold less than the
//! budget, or while it holds less than [`FLOOR`] itself: peers that spend the budget on
//! unfinished messages pause only themselves, never a publisher whose batches are small. A
//! message that does not finish within its deadline closes its connection, so a slow peer
//! cannot hold its share for ever. Together they hold at most the budget plus, per connection,
//! [`FLOOR`] and one read ([`READ_CHUNK`]).
//!
//! What is counted is what is resident: a frame announced larger than the buffer gets room for
//! all of it at once (one allocation of its size, whose pages become resident only as its bytes
//! arrive; not a doubling chain whose copies and freed blocks cost a multiple of it), and a
//! buffer grown for a large message is given back once that message is taken, so a connection
//! between messages holds what it has read, not the largest message it ever had. Bytes read ahead of a stream that waits (behind its replay) are
//! at most one round of reads ([`READS_PER_ROUND`] × [`READ_CHUNK`], 1 MiB), and counted.
//!
//! **What is sent is bounded too**, and counted in the same budget: each connection's unsent
//! bytes are an [`Outbox`] (its own few messages, at most [`MAX_QUEUED`], and at most one PONG
//! waiting, answering the latest PING), and the kernel's send buffer is set small
//! ([`SEND_BUFFER`]; a client sends only those). A peer that will not read is dropped
//! ([`ConnError::SendStalled`]) once bytes for it have waited longer than [`Timeouts::send`],
//! in the outbox or in the kernel's queue (sent and not acknowledged: a peer that reads nothing
//! closes its receive window, so what we sent stays there). An honest peer takes each PONG
//! within a round trip; the drop does not wait for the kernel's buffers to fill, which at one
//! PONG a round could take minutes.

mod outbox;

pub use outbox::{Full, Outbox, MAX_QUEUED};

use super::zmtp::{self, Decoder, Item, Limits, SocketType, ZmtpError};
use bytes::BytesMut;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// Largest single read (the scratch buffer the event thread lends every connection).
pub const READ_CHUNK: usize = 64 << 10;
/// Reads one connection gets per round before the next connection's turn.
pub const READS_PER_ROUND: usize = 16;
/// Bytes of an unfinished message any connection may hold whatever the others hold: an honest
/// publisher's batches (kilobytes; a long prefill's, a few hundred) fit, so peers that spend the
/// shared budget never stall it.
pub const FLOOR: usize = 1 << 20;
/// A buffer grown past this for a large message is given back once the message is taken.
const SHED_ABOVE: usize = 4 * READ_CHUNK;
/// The kernel send buffer asked for each connection (Linux doubles it): room for everything a
/// client sends, instead of megabytes of PONGs queued in the kernel for a peer that will not
/// read.
pub const SEND_BUFFER: usize = 4 << 10;

/// Bytes of unfinished messages all connections may hold together.
#[derive(Debug)]
pub struct Budget {
    used: usize,
    limit: usize,
    /// A buffer grown for a large message was let go since the last [`Budget::take_released`].
    released: bool,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: 0,
            limit,
            released: false,
        }
    }

    /// Whether a buffer grown for a large message was let go since the last call: the event
    /// thread then hands the freed pages back to the OS at the end of its round, so a stream of
    /// maximum-size messages holds one of them in memory, not as many as the allocator would
    /// keep for reuse.
    pub fn take_released(&mut self) -> bool {
        std::mem::take(&mut self.released)
    }

    /// Whether a connection holding `held` bytes may read more now: while all of them together
    /// hold less than the limit, or while it holds less than [`FLOOR`] itself (a peer that
    /// hogs the budget then pauses only itself).
    pub fn may_read(&self, held: usize) -> bool {
        self.used < self.limit || held < FLOOR
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used
    }

    /// All of it is held: only connections under [`FLOOR`] read on.
    pub fn spent(&self) -> bool {
        self.used >= self.limit
    }
}

/// Why a connection ended.
#[derive(Debug)]
pub enum ConnError {
    /// The socket failed (refused, reset, unreachable).
    Io(io::Error),
    /// The peer closed the connection.
    Closed,
    /// The peer broke the protocol or a cap.
    Zmtp(ZmtpError),
    /// The handshake or a message took longer than allowed.
    TooSlow(&'static str),
    /// The peer left what we sent unread for longer than [`Timeouts::send`].
    SendStalled,
    /// A message would take the outbox past [`MAX_QUEUED`].
    SendFull,
}

impl ConnError {
    /// Why the connection was dropped for not reading what we send (the metric's label), when
    /// it was.
    pub fn send_drop_reason(&self) -> Option<&'static str> {
        match self {
            ConnError::SendStalled => Some("stalled"),
            ConnError::SendFull => Some("full"),
            _ => None,
        }
    }
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Io(e) => write!(f, "{e}"),
            ConnError::Closed => f.write_str("closed by the peer"),
            ConnError::Zmtp(e) => write!(f, "{e}"),
            ConnError::TooSlow(what) => write!(f, "{what} took too long"),
            ConnError::SendStalled => f.write_str("the peer does not read what is sent to it"),
            ConnError::SendFull => f.write_str("the send queue is full"),
        }
    }
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> Self {
        ConnError::Io(e)
    }
}

/// Deadlines of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From connect to the peer's READY.
    pub handshake: Duration,
    /// From the first byte of a message to its last.
    pub message: Duration,
    /// Longest bytes for the peer may wait (in the outbox, or unacknowledged in the kernel's
    /// queue) before it counts as not reading.
    pub send: Duration,
}

/// One connection (see the module doc). Dropping it closes the socket and returns its bytes to
/// the budget only through [`Conn::close`]; the event thread always closes through it.
pub struct Conn {
    stream: TcpStream,
    kind: SocketType,
    connecting: bool,
    decoder: Decoder,
    rx: BytesMut,
    /// `rx` was given room for a large frame (it is replaced once that message is taken).
    grown: bool,
    tx: Outbox,
    /// Bytes this connection counts in the budget.
    held: usize,
    opened: Instant,
    /// Since when an incomplete message has been waiting for its bytes.
    incomplete_since: Option<Instant>,
    /// Bytes were written since the kernel's queue was last seen empty.
    in_kernel: bool,
    /// Since when bytes for the peer have been waiting (outbox or kernel queue), as the checks
    /// saw it.
    unsent_since: Option<Instant>,
    timeouts: Timeouts,
    /// The events the reader's epoll set watches on this socket (0: not in the set). A new
    /// connection is in no set, and closing one takes it out of every set.
    pub watched: u32,
}

impl Conn {
    /// Start connecting to `addr` (the handshake follows once the socket is writable); its
    /// greeting, queued, counts in `budget` from now.
    pub fn connect(
        addr: SocketAddr,
        kind: SocketType,
        limits: Limits,
        timeouts: Timeouts,
        budget: &mut Budget,
        now: Instant,
    ) -> io::Result<Conn> {
        use socket2::{Domain, Protocol, SockAddr, Socket, TcpKeepalive, Type};
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        // A peer that vanished without a FIN is noticed in about 25 s and redialled.
        let keepalive = TcpKeepalive::new()
            .with_time(Duration::from_secs(10))
            .with_interval(Duration::from_secs(5))
            .with_retries(3);
        s.set_tcp_keepalive(&keepalive)?;
        s.set_send_buffer_size(SEND_BUFFER)?;
        match s.connect(&SockAddr::from(addr)) {
            Ok(()) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINPROGRESS)
                    || e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let mut c = Conn {
            stream: s.into(),
            kind,
            connecting: true,
            decoder: Decoder::new(kind, limits),
            rx: BytesMut::new(),
            grown: false,
            tx: Outbox::new(zmtp::hello(kind)),
            held: 0,
            opened: now,
            incomplete_since: None,
            in_kernel: false,
            unsent_since: None,
            timeouts,
            watched: 0,
        };
        c.account(budget);
        Ok(c)
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// What to poll for: writable while connecting or with bytes to send; readable when
    /// `read` (the caller wants messages and the budget has room).
    pub fn events(&self, read: bool) -> i16 {
        let mut ev = 0;
        if self.connecting || !self.tx.unsent().is_empty() {
            ev |= libc::POLLOUT;
        }
        if read && !self.connecting {
            ev |= libc::POLLIN;
        }
        ev
    }

    /// Whether the handshake is done (messages may be sent).
    pub fn is_ready(&self) -> bool {
        self.decoder.is_ready()
    }

    /// The socket is writable: finish connecting, send what is queued.
    pub fn writable(&mut self, budget: &mut Budget) -> Result<(), ConnError> {
        if self.connecting {
            if let Some(e) = self.stream.take_error()? {
                return Err(ConnError::Io(e));
            }
            self.connecting = false;
        }
        let r = self.flush();
        self.account(budget);
        r
    }

    /// Queue a message (sent as the socket takes it); refused past the outbox's cap
    /// ([`ConnError::SendFull`]).
    pub fn send(&mut self, frames: &[&[u8]], budget: &mut Budget) -> Result<(), ConnError> {
        self.tx.push(frames).map_err(|Full| ConnError::SendFull)?;
        let r = self.flush();
        self.account(budget);
        r
    }

    /// Write what the socket takes now (the rest waits for it to be writable).
    fn flush(&mut self) -> Result<(), ConnError> {
        if self.connecting {
            return Ok(());
        }
        loop {
            let bytes = self.tx.unsent();
            if bytes.is_empty() {
                return Ok(());
            }
            match self.stream.write(bytes) {
                Ok(0) => return Err(ConnError::Closed),
                Ok(n) => {
                    self.tx.wrote(n);
                    self.in_kernel = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether this connection may be read now (see [`Budget::may_read`]).
    pub fn may_read(&self, budget: &Budget) -> bool {
        budget.may_read(self.held)
    }

    /// The socket is readable: take what it has (a bounded number of reads, while the budget
    /// lets this connection read) into this connection's buffer.
    pub fn fill(&mut self, budget: &mut Budget, scratch: &mut [u8]) -> Result<(), ConnError> {
        for _ in 0..READS_PER_ROUND {
            if !budget.may_read(self.held) {
                break;
            }
            // A large frame announced (within the caps) but not all here: room for all of it
            // and the rest of this round's reads past it, at once.
            if let Some(need) = self.decoder.awaiting(&self.rx) {
                let room = need + READS_PER_ROUND * READ_CHUNK;
                if need > SHED_ABOVE && room > self.rx.capacity() {
                    self.rx.reserve(room - self.rx.len());
                    self.grown = true;
                }
            }
            match self.stream.read(scratch) {
                Ok(0) => return Err(ConnError::Closed),
                Ok(n) => {
                    self.rx.extend_from_slice(&scratch[..n]);
                    self.account(budget);
                    if n < scratch.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The next whole item in what was read (`None`: it has not all arrived). PINGs are
    /// answered here: the latest one's PONG is written (or waits) once the PINGs read so far
    /// are taken.
    pub fn next(&mut self, budget: &mut Budget, now: Instant) -> Result<Option<Item>, ConnError> {
        let mut pinged = false;
        let r = self.next_item(&mut pinged, budget, now);
        if pinged {
            let flushed = self.flush();
            self.account(budget);
            flushed?;
        }
        r
    }

    fn next_item(
        &mut self,
        pinged: &mut bool,
        budget: &mut Budget,
        now: Instant,
    ) -> Result<Option<Item>, ConnError> {
        loop {
            let item = self.decoder.decode(&mut self.rx).map_err(ConnError::Zmtp);
            self.account(budget);
            match item? {
                Some(Item::Ping(ctx)) => {
                    self.tx.pong(&ctx);
                    *pinged = true;
                    // A whole command: no message is under way (none may hold one).
                    self.incomplete_since = None;
                }
                Some(item) => {
                    if item == Item::Ready && self.kind == SocketType::Sub {
                        self.send(&zmtp::SUBSCRIBE_ALL, budget)?;
                    }
                    if matches!(item, Item::Message(_)) {
                        self.shed(budget);
                    }
                    self.incomplete_since = None;
                    return Ok(Some(item));
                }
                None => {
                    if self.rx.is_empty() && !self.decoder.in_message() {
                        self.incomplete_since = None;
                    } else if self.incomplete_since.is_none() {
                        self.incomplete_since = Some(now);
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// The handshake and the message being received are within their deadlines, and so is what
    /// waits to be sent ([`Conn::check_send`]). The caller skips a stream it does not read on
    /// purpose (one waiting behind its replay: not slow, its reader is; it checks only
    /// [`Conn::check_send`]); one the budget pauses is checked (it holds at least [`FLOOR`] of
    /// an unfinished message, and its deadline is how that share comes back).
    pub fn check(&mut self, now: Instant) -> Result<(), ConnError> {
        self.check_send(now)?;
        if !self.is_ready() && now.duration_since(self.opened) > self.timeouts.handshake {
            return Err(ConnError::TooSlow("the ZMTP handshake"));
        }
        if self
            .incomplete_since
            .is_some_and(|t| now.duration_since(t) > self.timeouts.message)
        {
            return Err(ConnError::TooSlow("one message"));
        }
        Ok(())
    }

    /// The peer has taken what we send within [`Timeouts::send`]: bytes for it have not waited
    /// (in the outbox, or in the kernel's queue unacknowledged) through every check for longer
    /// (a peer that will not read is dropped: [`ConnError::SendStalled`]). Called every round.
    pub fn check_send(&mut self, now: Instant) -> Result<(), ConnError> {
        if self.connecting {
            return Ok(());
        }
        let waiting = !self.tx.is_empty() || (self.in_kernel && self.kernel_queue() > 0);
        if !waiting {
            self.in_kernel = false;
            self.unsent_since = None;
            return Ok(());
        }
        let since = *self.unsent_since.get_or_insert(now);
        if now.saturating_duration_since(since) > self.timeouts.send {
            return Err(ConnError::SendStalled);
        }
        Ok(())
    }

    /// Bytes in the kernel's send queue: not yet sent, or sent and not acknowledged (0 when it
    /// cannot be read).
    fn kernel_queue(&self) -> usize {
        let mut queued: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer, which is valid and
        // writable for the call; the descriptor is this connection's open socket.
        let r = unsafe { libc::ioctl(self.fd(), libc::TIOCOUTQ, &mut queued as *mut libc::c_int) };
        if r == 0 {
            usize::try_from(queued).unwrap_or(0)
        } else {
            0
        }
    }

    /// After a message: a buffer grown for a large frame keeps only what it still holds (at most
    /// a round of reads), in a buffer of that size; the large one is freed with the message.
    fn shed(&mut self, budget: &mut Budget) {
        let oversized = self.rx.capacity() > SHED_ABOVE && self.rx.len() <= self.rx.capacity() / 4;
        if self.grown || oversized {
            self.rx = BytesMut::from(&self.rx[..]);
            self.grown = false;
            budget.released = true;
        }
    }

    /// Count what this connection holds now in `budget`: bytes read and not yet taken, the
    /// unfinished message, and what waits to be sent.
    fn account(&mut self, budget: &mut Budget) {
        let now_held = self.rx.len() + self.decoder.held_bytes() as usize + self.tx.held();
        budget.used = budget.used + now_held - self.held;
        self.held = now_held;
    }

    /// Close the socket and give its bytes back to the budget.
    pub fn close(self, budget: &mut Budget) {
        budget.used -= self.held;
        budget.released |= self.rx.capacity() > SHED_ABOVE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const LIMITS: Limits = Limits {
        max_frames: 4,
        max_message_bytes: 1 << 20,
        max_command_bytes: 4096,
    };
    const TIMEOUTS: Timeouts = Timeouts {
        handshake: Duration::from_secs(5),
        message: Duration::from_millis(200),
        send: Duration::from_millis(300),
    };

    /// A peer written out by hand: greeting and READY as a PUB, then `rest`.
    /// A connection to `addr` with the tests' timeouts, started now.
    fn connect_now(
        addr: SocketAddr,
        kind: SocketType,
        limits: Limits,
        budget: &mut Budget,
    ) -> Conn {
        Conn::connect(addr, kind, limits, TIMEOUTS, budget, Instant::now()).unwrap()
    }

    fn publisher_bytes(rest: &[u8]) -> Vec<u8> {
        let mut b = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
        b.extend_from_slice(b"NULL");
        b.resize(64, 0);
        let body = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
        b.extend_from_slice(&[0x04, body.len() as u8]);
        b.extend_from_slice(body);
        b.extend_from_slice(rest);
        b
    }

    /// Wait at most `ms` for `c` to be ready (for reading too when `read`); its `revents`.
    fn poll_conn(c: &Conn, read: bool, ms: i32) -> i16 {
        let mut fds = [libc::pollfd {
            fd: c.fd(),
            events: c.events(read),
            revents: 0,
        }];
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        fds[0].revents
    }

    /// One turn of an event loop: wait at most `ms`, then write what is pending and read
    /// what arrived (`wake` says which readiness reads).
    fn turn(c: &mut Conn, budget: &mut Budget, scratch: &mut [u8], ms: i32, wake: i16) {
        let revents = poll_conn(c, true, ms);
        if revents & libc::POLLOUT != 0 {
            c.writable(budget).unwrap();
        }
        if revents & wake != 0 {
            if let Err(e) = c.fill(budget, scratch) {
                panic!("{e}");
            }
        }
    }

    fn pump(c: &mut Conn, budget: &mut Budget, until: impl Fn(&[Item]) -> bool) -> Vec<Item> {
        let mut scratch = vec![0u8; READ_CHUNK];
        let mut items = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !until(&items) {
            assert!(Instant::now() < deadline, "nothing arrived: {items:?}");
            turn(c, budget, &mut scratch, 50, libc::POLLIN | libc::POLLHUP);
            while let Some(item) = c.next(budget, Instant::now()).unwrap() {
                items.push(item);
            }
        }
        items
    }

    #[test]
    fn connects_greets_and_reads_a_message_with_the_budget_accounted() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = vec![0u8; zmtp::hello(SocketType::Sub).len()];
            s.read_exact(&mut got).unwrap();
            s.write_all(&publisher_bytes(
                b"\x01\x00\x01\x08\x00\x00\x00\x00\x00\x00\x00\x05\x00\x03abc",
            ))
            .unwrap();
            got
        });
        let mut budget = Budget::new(1 << 20);
        let mut c = connect_now(addr, SocketType::Sub, LIMITS, &mut budget);
        let items = pump(&mut c, &mut budget, |i| i.len() == 2);
        assert_eq!(items[0], Item::Ready);
        let Item::Message(frames) = &items[1] else {
            panic!("{items:?}")
        };
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[2][..], b"abc");
        assert_eq!(budget.used(), 0, "nothing left over");
        let sent = server.join().unwrap();
        assert_eq!(
            sent,
            zmtp::hello(SocketType::Sub),
            "our hello, byte for byte"
        );
        c.close(&mut budget);
    }

    #[test]
    fn a_message_that_never_finishes_is_too_slow_and_its_bytes_come_back() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            // A frame announcing 1000 bytes, of which 10 arrive.
            let mut head = publisher_bytes(b"\x02");
            head.extend_from_slice(&1000u64.to_be_bytes());
            head.extend_from_slice(&[7u8; 10]);
            s.write_all(&head).unwrap();
            let _ = rx.recv();
        });
        let mut budget = Budget::new(1 << 20);
        let mut c = connect_now(addr, SocketType::Sub, LIMITS, &mut budget);
        pump(&mut c, &mut budget, |i| i.len() == 1);
        let until = Instant::now() + Duration::from_secs(5);
        let mut scratch = vec![0u8; READ_CHUNK];
        // The 9-byte header and 10 body bytes, held.
        while budget.used() < 19 {
            assert!(Instant::now() < until, "{}", budget.used());
            std::thread::sleep(Duration::from_millis(5));
            c.fill(&mut budget, &mut scratch).unwrap();
            assert_eq!(c.next(&mut budget, Instant::now()).unwrap(), None);
        }
        assert!(c.check(Instant::now()).is_ok());
        std::thread::sleep(Duration::from_millis(250));
        assert!(matches!(
            c.check(Instant::now()),
            Err(ConnError::TooSlow("one message"))
        ));
        c.close(&mut budget);
        assert_eq!(budget.used(), 0);
        tx.send(()).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn a_connection_holding_little_reads_while_others_spend_the_budget() {
        let mut budget = Budget::new(4 * FLOOR);
        assert!(budget.may_read(0) && budget.may_read(3 * FLOOR));
        budget.used = 4 * FLOOR;
        // The budget is spent: those holding a floor's worth wait, the others read on.
        assert!(!budget.may_read(FLOOR) && !budget.may_read(3 * FLOOR));
        assert!(budget.may_read(0) && budget.may_read(FLOOR - 1));
    }

    #[test]
    fn a_large_frame_is_read_into_one_buffer_of_its_size_given_back_after_its_message() {
        const LARGE: Limits = Limits {
            max_frames: 4,
            max_message_bytes: 16 << 20,
            max_command_bytes: 4096,
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // Not a power of two: a buffer doubling its way there would overshoot by megabytes.
        let size = (4usize << 20) + (512 << 10);
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = vec![0u8; zmtp::hello(SocketType::Sub).len()];
            s.read_exact(&mut got).unwrap();
            let mut msg = Vec::new();
            zmtp::encode_message(&[b"", &7i64.to_be_bytes(), &vec![9u8; size]], &mut msg);
            s.write_all(&publisher_bytes(&msg)).unwrap();
            // Keep the connection open until the reader is done.
            let _ = s.read(&mut [0u8; 16]);
        });
        let mut budget = Budget::new(64 << 20);
        let mut c = connect_now(addr, SocketType::Sub, LARGE, &mut budget);
        let mut scratch = vec![0u8; READ_CHUNK];
        let mut largest = 0;
        let mut items = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while items.len() < 2 {
            assert!(Instant::now() < deadline, "{items:?}");
            turn(&mut c, &mut budget, &mut scratch, 50, libc::POLLIN);
            largest = largest.max(c.rx.capacity());
            while let Some(item) = c.next(&mut budget, Instant::now()).unwrap() {
                items.push(item);
            }
        }
        let Item::Message(frames) = &items[1] else {
            panic!("{items:?}")
        };
        assert_eq!(frames[2].len(), size);
        // One buffer for the frame and a round of reads past it: never a doubling to 8 MiB.
        assert!(largest >= size, "{largest}");
        assert!(
            largest <= size + 9 + (READS_PER_ROUND + 1) * READ_CHUNK,
            "the buffer grew to {largest} bytes for a {size}-byte frame"
        );
        // Once the message is taken the buffer is small again.
        assert!(c.rx.capacity() <= SHED_ABOVE, "{}", c.rx.capacity());
        assert_eq!(budget.used(), 0);
        c.close(&mut budget);
        server.join().unwrap();
    }

    /// A listener on 127.0.0.1 whose connections take at most a few KiB before the sender
    /// must wait (a peer that reads nothing fills at once).
    fn small_window_listener() -> TcpListener {
        use socket2::{Domain, SockAddr, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        s.set_recv_buffer_size(4096).unwrap();
        s.bind(&SockAddr::from(SocketAddr::from(([127, 0, 0, 1], 0))))
            .unwrap();
        s.listen(1).unwrap();
        s.into()
    }

    #[test]
    fn a_peer_flooding_pings_that_never_reads_holds_one_pong_and_is_dropped_in_time() {
        let l = small_window_listener();
        let addr = l.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_nodelay(true).unwrap();
            s.write_all(&publisher_bytes(b"")).unwrap();
            // PINGs (TTL 0, a 4-byte context) as fast as taken, never a byte read; each
            // write's bytes go whole (a write cut short would split a frame).
            s.set_write_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let mut pings = 0u64;
            let mut chunk = Vec::new();
            'flood: while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                chunk.clear();
                for _ in 0..256 {
                    pings += 1;
                    chunk.extend_from_slice(b"\x04\x0b\x04PING\x00\x00");
                    chunk.extend_from_slice(&(pings as u32).to_be_bytes());
                }
                let mut rest = &chunk[..];
                while !rest.is_empty() {
                    if stop2.load(std::sync::atomic::Ordering::Relaxed) {
                        break 'flood;
                    }
                    match s.write(rest) {
                        Ok(n) => rest = &rest[n..],
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                        Err(_) => break 'flood,
                    }
                }
            }
            pings
        });
        let mut budget = Budget::new(1 << 20);
        let start = Instant::now();
        // A PING flood stalls itself now and then (segments the peer's kernel drops wait for a
        // retransmission): what would pass a short message deadline.
        let timeouts = Timeouts {
            message: Duration::from_secs(30),
            ..TIMEOUTS
        };
        let mut c =
            Conn::connect(addr, SocketType::Sub, LIMITS, timeouts, &mut budget, start).unwrap();
        let mut scratch = vec![0u8; READ_CHUNK];
        let (mut most_held, mut most_used) = (0, 0);
        let dropped = loop {
            assert!(start.elapsed() < Duration::from_secs(10), "never dropped");
            turn(&mut c, &mut budget, &mut scratch, 20, libc::POLLIN);
            let now = Instant::now();
            while let Some(item) = c.next(&mut budget, now).unwrap() {
                assert_eq!(item, Item::Ready);
            }
            most_held = most_held.max(c.tx.held());
            most_used = most_used.max(budget.used());
            if let Err(e) = c.check(Instant::now()) {
                break e;
            }
        };
        let after = start.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        c.close(&mut budget);
        assert_eq!(budget.used(), 0, "its bytes came back");
        let pings = server.join().unwrap();
        assert!(matches!(dropped, ConnError::SendStalled), "{dropped}");
        assert_eq!(dropped.send_drop_reason(), Some("stalled"));
        assert!(after > timeouts.send, "dropped after {after:?}");
        // Far more PONGs were owed than the kernel buffers hold; we held two at most (one being
        // written, one waiting), and they were counted in the budget.
        assert!(pings > 20_000, "only {pings} PINGs sent");
        assert!(
            most_held <= 2 * 11 + 3,
            "{most_held} bytes waited to be sent"
        );
        assert!(
            most_used <= READS_PER_ROUND * READ_CHUNK + most_held,
            "{most_used}"
        );
    }

    #[test]
    fn pings_arriving_whole_keep_no_message_deadline_running() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let ping = b"\x04\x0b\x04PING\x00\x00abcd";
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_nodelay(true).unwrap();
            s.write_all(&publisher_bytes(&ping[..6])).unwrap();
            // Eight times: the rest of one PING and half of the next, 100 ms apart (800 ms in
            // all, past the 500 ms message deadline; no gap near it).
            for _ in 0..8 {
                std::thread::sleep(Duration::from_millis(100));
                let mut b = ping[6..].to_vec();
                b.extend_from_slice(&ping[..6]);
                s.write_all(&b).unwrap();
            }
            let mut got = Vec::new();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut buf = [0u8; 4096];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                if got.ends_with(b"PONGabcd") {
                    break;
                }
            }
            // Open until the reader is done.
            let _ = wait.recv();
            got
        });
        let timeouts = Timeouts {
            message: Duration::from_millis(500),
            ..TIMEOUTS
        };
        let mut budget = Budget::new(1 << 20);
        let start = Instant::now();
        let mut c =
            Conn::connect(addr, SocketType::Sub, LIMITS, timeouts, &mut budget, start).unwrap();
        let mut scratch = vec![0u8; READ_CHUNK];
        while start.elapsed() < Duration::from_millis(1000) {
            turn(&mut c, &mut budget, &mut scratch, 20, libc::POLLIN);
            while let Some(item) = c.next(&mut budget, Instant::now()).unwrap() {
                assert_eq!(item, Item::Ready);
            }
            // Half a PING always waits, never longer than 100 ms.
            c.check(Instant::now()).unwrap();
        }
        done.send(()).unwrap();
        let got = server.join().unwrap();
        assert!(got.ends_with(b"\x04\x09\x04PONGabcd"), "answered");
        c.close(&mut budget);
    }

    #[test]
    fn a_refused_connection_fails_on_the_first_write_readiness() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let mut budget = Budget::new(1 << 20);
        let mut c = connect_now(addr, SocketType::Dealer, LIMITS, &mut budget);
        poll_conn(&c, false, 2000);
        assert!(c.writable(&mut budget).is_err());
    }
}
