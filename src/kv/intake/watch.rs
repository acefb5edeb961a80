//! A reader's epoll set (level-triggered): a round costs the sockets that are ready, not every
//! socket the reader holds, which with thousands of publishers a `poll(2)` over all of them did.
//! Each connection records what the set watches on it ([`Conn::watched`]), so only a change of
//! interest costs a system call; closing a connection takes it out of the set.

use crate::kv::socket::Conn;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Events one wait returns at most (the rest stay ready for the next).
const MAX_EVENTS: usize = 1024;

pub(super) struct Watch {
    epoll: OwnedFd,
    ready: Vec<libc::epoll_event>,
}

impl Watch {
    pub(super) fn new() -> io::Result<Watch> {
        // SAFETY: plain system call; the descriptor is owned below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Watch {
            // SAFETY: `fd` is a new descriptor nothing else owns.
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
            ready: Vec::with_capacity(MAX_EVENTS),
        })
    }

    /// Watch `conn` for `want` (`poll(2)` bits: `POLLIN`, `POLLOUT`, the same values as epoll's),
    /// tagged `tag`; nothing when it already is, out of the set when `want` is 0.
    pub(super) fn set(&self, conn: &mut Conn, want: i16, tag: u64) -> io::Result<()> {
        let want = want as u16 as u32 & (libc::EPOLLIN | libc::EPOLLOUT) as u32;
        if want == conn.watched {
            return Ok(());
        }
        let op = match (conn.watched, want) {
            (0, _) => libc::EPOLL_CTL_ADD,
            (_, 0) => libc::EPOLL_CTL_DEL,
            _ => libc::EPOLL_CTL_MOD,
        };
        let mut ev = libc::epoll_event {
            events: want,
            u64: tag,
        };
        // SAFETY: both descriptors are open; `ev` lives for the call.
        let r = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, conn.fd(), &mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        conn.watched = want;
        Ok(())
    }

    /// Wait at most `ms` (0: do not wait) for ready sockets: their tags and `poll(2)`-style
    /// events.
    pub(super) fn wait(&mut self, ms: i32) -> impl Iterator<Item = (u64, i16)> + '_ {
        self.ready.clear();
        // SAFETY: `ready` has room for MAX_EVENTS entries; the kernel fills `n` of them.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll.as_raw_fd(),
                self.ready.as_mut_ptr(),
                MAX_EVENTS as i32,
                ms,
            )
        };
        // SAFETY: the kernel initialised the first `n` entries (none on an error).
        unsafe { self.ready.set_len(n.max(0) as usize) };
        self.ready.iter().map(|e| {
            let (tag, events) = (e.u64, e.events);
            (tag, events as i16)
        })
    }
}
