//! One core's table of open client connections, so the accept loop can hold them under
//! `--max-connections-per-core` and shed the longest-idle keep-alive connection first. Pure
//! bookkeeping on one thread (plain cells, no I/O): tested alone.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// One core's open client connections, so the accept loop can hold them under
/// `--max-connections-per-core`. At the cap, the connection idle the longest (waiting for its
/// next request, or for its first) is told to close: it is the one whose loss costs nobody a
/// request. Single-threaded (one per core), so plain cells.
pub struct Connections {
    /// 0: no cap.
    cap: usize,
    /// Connections counted against the cap (a shed one stops counting at once).
    open: Cell<usize>,
    /// Idle connections in the order they fell idle, with the mark they had then; an entry
    /// whose slot has since moved on (busy, idle again, closed) is stale and skipped.
    idle: RefCell<VecDeque<(Rc<SlotState>, u64)>>,
    /// Source of idle marks (0 means "not idle").
    marks: Cell<u64>,
}

/// The state a connection and its table share.
#[derive(Default)]
pub struct SlotState {
    /// The mark of the current idle period, 0 while busy.
    idle_mark: Cell<u64>,
    /// The table told this connection to close.
    shed: Cell<bool>,
    /// Woken when `shed` is set.
    waker: Cell<Option<Waker>>,
}

/// A connection's place in its core's [`Connections`]; leaving it (drop) frees the place.
pub struct Slot {
    table: Rc<Connections>,
    state: Rc<SlotState>,
}

impl Connections {
    /// A table holding at most `cap` connections (0: no cap).
    pub fn new(cap: usize) -> Rc<Connections> {
        Rc::new(Connections {
            cap,
            open: Cell::new(0),
            idle: RefCell::new(VecDeque::new()),
            marks: Cell::new(0),
        })
    }

    /// Connections counted against the cap.
    pub fn open(&self) -> usize {
        self.open.get()
    }

    /// A place for a newly accepted connection: free below the cap, else taken from the
    /// longest-idle connection (told to close); `None` when every connection is busy.
    pub fn admit(self: &Rc<Self>) -> Option<Slot> {
        if self.cap != 0 && self.open.get() >= self.cap && !self.shed_oldest_idle() {
            return None;
        }
        self.open.set(self.open.get() + 1);
        Some(Slot {
            table: self.clone(),
            state: Rc::new(SlotState::default()),
        })
    }

    /// Tell the connection idle the longest to close. False when none is idle.
    pub fn shed_oldest_idle(&self) -> bool {
        let mut idle = self.idle.borrow_mut();
        while let Some((state, mark)) = idle.pop_front() {
            if state.idle_mark.get() == mark {
                state.idle_mark.set(0);
                state.shed.set(true);
                self.open.set(self.open.get().saturating_sub(1));
                if let Some(w) = state.waker.take() {
                    w.wake();
                }
                return true;
            }
        }
        false
    }
}

impl Slot {
    /// Waiting for the first byte of a request: may be shed from now on.
    pub(super) fn idle(&self) {
        if self.state.idle_mark.get() != 0 || self.state.shed.get() {
            return;
        }
        let mark = self.table.marks.get() + 1;
        self.table.marks.set(mark);
        self.state.idle_mark.set(mark);
        let mut idle = self.table.idle.borrow_mut();
        // Stale entries pile up while nobody sheds; drop them once they outnumber the live.
        if idle.len() > 2 * self.table.open.get() + 64 {
            idle.retain(|(s, m)| s.idle_mark.get() == *m);
        }
        idle.push_back((self.state.clone(), mark));
    }

    /// A request has started: not to be shed.
    pub(super) fn busy(&self) {
        self.state.idle_mark.set(0);
    }

    /// Resolves once the table has told this connection to close.
    pub(super) fn shed(&self) -> ShedSignal<'_> {
        ShedSignal(&self.state)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.idle_mark.set(0);
        if !self.state.shed.get() {
            self.table.open.set(self.table.open.get().saturating_sub(1));
        }
    }
}

/// The future of [`Slot::shed`].
pub(super) struct ShedSignal<'a>(&'a SlotState);

impl Future for ShedSignal<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0.shed.get() {
            return Poll::Ready(());
        }
        self.0.waker.set(Some(cx.waker().clone()));
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_the_longest_idle_connection_is_shed_and_busy_ones_are_kept() {
        let t = Connections::new(3);
        let a = t.admit().unwrap();
        let b = t.admit().unwrap();
        let c = t.admit().unwrap();
        b.idle();
        a.idle();
        c.idle();
        c.busy();
        // Full: b fell idle first.
        let d = t.admit().unwrap();
        assert!(b.state.shed.get() && !a.state.shed.get());
        assert_eq!(t.open(), 3);
        // a is idle, c and d busy: a goes next; then nobody is idle.
        let e = t.admit().unwrap();
        assert!(a.state.shed.get());
        assert!(t.admit().is_none());
        assert_eq!(t.open(), 3);
        // A closed connection frees its place; a shed one does not count twice.
        drop((a, b));
        assert_eq!(t.open(), 3);
        drop(d);
        assert_eq!(t.open(), 2);
        assert!(t.admit().is_some());
        drop((c, e));
        assert_eq!(t.open(), 0);
    }

    #[test]
    fn stale_idle_entries_do_not_pile_up() {
        let t = Connections::new(0);
        let a = t.admit().unwrap();
        for _ in 0..10_000 {
            a.idle();
            a.busy();
        }
        assert!(t.idle.borrow().len() <= 2 * t.open() + 65);
        // No cap: never refused, nothing shed.
        let many: Vec<Slot> = (0..100).map(|_| t.admit().unwrap()).collect();
        assert_eq!(t.open(), 101);
        drop(many);
    }
}
