//! The few Linux calls the streaming tools make, wrapped so the rest never writes `unsafe`: an
//! epoll set with a sub-millisecond wait, non-blocking IPv4 TCP sockets, the monotonic clock
//! and the descriptor limit. Raw syscalls rather than a runtime, because the upstream and the
//! load generator share one CPU and must each carry 100k+ events/s on a fraction of it.

use std::io;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;

/// Nanoseconds of CLOCK_MONOTONIC: one clock for the whole machine on Linux, so the load
/// generator can subtract the upstream's `sent_ns` stamp from its own reading.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Raise the open-file soft limit to the hard limit, and return the limit now in force: every
/// stream is a descriptor, and the usual 1,024 would cap a run at a thousand streams.
pub fn raise_nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid, initialised rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return lim.rlim_max;
            }
        }
    }
    lim.rlim_cur
}

/// Put the calling thread in SCHED_BATCH: its wake-ups then do not preempt the task running on
/// its CPU. The upstream and the load generator share one CPU; without it, every event the
/// upstream writes wakes the load generator, which preempts the upstream to read that one
/// event, and the pair pays two context switches per event instead of handling batches.
/// Best effort: a failure leaves the normal policy. `STREAMS_SCHED=normal` in the environment
/// keeps the normal policy (on a CPU shared with other work, a SCHED_BATCH task also cannot
/// preempt those on wake-up; compare both there).
pub fn batch_scheduling() {
    if std::env::var_os("STREAMS_SCHED").is_some_and(|v| v == "normal") {
        return;
    }
    // SAFETY: sched_setscheduler on this thread with a valid sched_param (priority 0, as
    // SCHED_BATCH requires).
    unsafe {
        let p = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_BATCH, &p);
    }
}

/// User plus system CPU seconds this process has used: the load generator reports its own cost
/// so a reader can tell whether it, rather than the proxy, was the limit.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills a zeroed rusage struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an owned rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Readiness bits, as epoll reports them.
pub const IN: u32 = libc::EPOLLIN as u32;
/// Writable.
pub const OUT: u32 = libc::EPOLLOUT as u32;
/// The peer closed, or the socket failed: read to find out which, then close.
pub const HUP: u32 = (libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32;

/// An epoll set. Owns its descriptor.
pub struct Epoll {
    fd: RawFd,
    /// Whether the kernel has epoll_pwait2 (5.11+): microsecond waits instead of milliseconds.
    pwait2: bool,
}

impl Epoll {
    /// A new, empty set.
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll { fd, pwait2: true })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: valid epoll fd and event struct.
        check(unsafe { libc::epoll_ctl(self.fd, op, fd, &mut ev) }).map(|_| ())
    }

    /// Watch `fd` for `events` (level-triggered), reported with `token`.
    pub fn add(&self, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        self.ctl(
            libc::EPOLL_CTL_ADD,
            fd,
            token,
            events | libc::EPOLLRDHUP as u32,
        )
    }

    /// Change what `fd` is watched for.
    pub fn modify(&self, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        self.ctl(
            libc::EPOLL_CTL_MOD,
            fd,
            token,
            events | libc::EPOLLRDHUP as u32,
        )
    }

    /// Wait for readiness, at most `timeout_ns` (None: without limit). Returns how many entries
    /// of `events` were filled; an interrupted wait returns 0.
    pub fn wait(
        &mut self,
        events: &mut [libc::epoll_event],
        timeout_ns: Option<u64>,
    ) -> io::Result<usize> {
        let max = events.len().min(i32::MAX as usize) as libc::c_int;
        let r = if self.pwait2 {
            let ts = timeout_ns.map(|ns| libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            });
            let tp = ts
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const libc::timespec);
            // SAFETY: epoll_pwait2(epfd, events, maxevents, timeout, sigmask = NULL, sigsetsize);
            // `events` is valid for `max` entries, `tp` null or a live timespec.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_epoll_pwait2,
                    self.fd,
                    events.as_mut_ptr(),
                    max,
                    tp,
                    std::ptr::null::<libc::sigset_t>(),
                    0usize,
                )
            };
            if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                self.pwait2 = false;
                return self.wait(events, timeout_ns);
            }
            r as libc::c_int
        } else {
            // Round up: waking early would spin until the due time.
            let ms = timeout_ns.map_or(-1, |ns| ns.div_ceil(1_000_000).min(i32::MAX as u64) as i32);
            // SAFETY: `events` is valid for `max` entries.
            unsafe { libc::epoll_wait(self.fd, events.as_mut_ptr(), max, ms) }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(r as usize)
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        close(self.fd);
    }
}

/// An empty event list of `n` entries for [`Epoll::wait`].
pub fn event_buffer(n: usize) -> Vec<libc::epoll_event> {
    vec![libc::epoll_event { events: 0, u64: 0 }; n]
}

/// Close a descriptor, ignoring errors (nothing useful can be done about them here).
pub fn close(fd: RawFd) {
    // SAFETY: the caller owns `fd` and never uses it again.
    unsafe { libc::close(fd) };
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn set_int_opt(fd: RawFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) {
    // SAFETY: setsockopt with a valid int option value.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

/// Turn Nagle off: every event is a small write that must leave at once.
pub fn set_nodelay(fd: RawFd) {
    set_int_opt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
}

/// A non-blocking listening socket on `addr` (port 0: any free port), with a deep backlog so
/// thousands of connects in a burst are not refused.
pub fn listen(addr: SocketAddrV4) -> io::Result<RawFd> {
    // SAFETY: plain syscall.
    let fd = check(unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    set_int_opt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1);
    let sa = sockaddr(addr);
    // SAFETY: `sa` is a valid sockaddr_in of the given length.
    let r = unsafe {
        libc::bind(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    // SAFETY: plain syscall on an owned socket.
    if let Err(e) = check(r).and_then(|_| check(unsafe { libc::listen(fd, 65535) })) {
        close(fd);
        return Err(e);
    }
    Ok(fd)
}

/// The local port of a bound socket.
pub fn local_port(fd: RawFd) -> io::Result<u16> {
    // SAFETY: getsockname into a zeroed sockaddr_in of the right length.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: as above.
    check(unsafe {
        libc::getsockname(
            fd,
            &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr,
            &mut len,
        )
    })?;
    Ok(u16::from_be(sa.sin_port))
}

/// Accept one connection, non-blocking, Nagle off. `Ok(None)`: none waiting.
pub fn accept(listener: RawFd) -> io::Result<Option<RawFd>> {
    // SAFETY: accept4 without an address buffer.
    let r = unsafe {
        libc::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    set_nodelay(r);
    Ok(Some(r))
}

/// Start a non-blocking connect to `addr`; it completes when the socket turns writable (then
/// [`take_error`] says whether it succeeded).
pub fn connect(addr: SocketAddrV4) -> io::Result<RawFd> {
    // SAFETY: plain syscall.
    let fd = check(unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    set_nodelay(fd);
    let sa = sockaddr(addr);
    // SAFETY: `sa` is a valid sockaddr_in of the given length.
    let r = unsafe {
        libc::connect(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            close(fd);
            return Err(e);
        }
    }
    Ok(fd)
}

/// The pending error of a socket (a finished non-blocking connect's outcome).
pub fn take_error(fd: RawFd) -> Option<io::Error> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int of the right length.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut v as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Some(io::Error::last_os_error());
    }
    (v != 0).then(|| io::Error::from_raw_os_error(v))
}

/// Outcome of one non-blocking read or write.
pub enum Io {
    /// This many bytes moved (a read of 0 is `Closed`).
    Done(usize),
    /// The socket would block.
    Again,
    /// The peer closed (read of 0 bytes).
    Closed,
    /// The socket failed (reset, broken pipe, ...).
    Failed(io::Error),
}

fn io_result(r: isize) -> Io {
    if r > 0 {
        return Io::Done(r as usize);
    }
    if r == 0 {
        return Io::Closed;
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Io::Again,
        _ => Io::Failed(e),
    }
}

/// One `read` into `buf`.
pub fn read(fd: RawFd, buf: &mut [u8]) -> Io {
    // SAFETY: `buf` is valid for writes of its length.
    io_result(unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) })
}

/// One `send` of `buf` (MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE). An empty buffer
/// is `Done(0)`.
pub fn write(fd: RawFd, buf: &[u8]) -> Io {
    if buf.is_empty() {
        return Io::Done(0);
    }
    // SAFETY: `buf` is valid for reads of its length.
    let r = unsafe {
        libc::send(
            fd,
            buf.as_ptr() as *const libc::c_void,
            buf.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    io_result(r)
}
