//! Where a core's waiters sleep. One waiter per core and room, the *watcher*, looks at the
//! rooms every [`super::TICK`] (the fleet's saturation changes without telling anyone: readings,
//! requests that end); every other waiter on that core is parked, costs nothing until it is
//! woken, and is woken when the watcher finds its verdict, when its own deadline passes, or to
//! become the watcher when the last one leaves. All of it lives on the core (thread-local, no
//! lock, no cross-thread waker): a verdict set by another core's watcher is found by this
//! core's watcher at its next look.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// Which waiters share a watcher: one flow's (by address) one room.
pub(super) type Spot = (usize, super::RoomKey);

#[derive(Default)]
struct Parked {
    waker: Option<Waker>,
    woken: bool,
}

/// One spot's waiters on this core.
#[derive(Default)]
struct Local {
    parked: HashMap<u64, Parked>,
    watcher: Option<u64>,
}

thread_local! {
    static LOCAL: RefCell<HashMap<Spot, Local>> = RefCell::new(HashMap::new());
}

fn with<R>(spot: Spot, f: impl FnOnce(&mut Local) -> R) -> R {
    LOCAL.with(|l| f(l.borrow_mut().entry(spot).or_default()))
}

/// A waiter's place among its core's waiters; leaving it (however the wait ends) hands the
/// watch on to another waiter of the same spot.
pub(super) struct Place {
    spot: Spot,
    ticket: u64,
}

impl Place {
    /// Waiter `ticket` of `spot` on this core.
    pub(super) fn take(spot: Spot, ticket: u64) -> Place {
        with(spot, |l| {
            l.parked.insert(ticket, Parked::default());
        });
        Place { spot, ticket }
    }

    /// Whether this waiter watches the rooms for its core (it becomes the watcher when there
    /// is none).
    pub(super) fn watching(&self) -> bool {
        with(self.spot, |l| {
            *l.watcher.get_or_insert(self.ticket) == self.ticket
        })
    }

    /// Resolves when this waiter is woken.
    pub(super) fn woken(&self) -> Woken<'_> {
        Woken { place: self }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        LOCAL.with(|all| {
            let mut all = all.borrow_mut();
            let Some(l) = all.get_mut(&self.spot) else {
                return;
            };
            l.parked.remove(&self.ticket);
            if l.watcher == Some(self.ticket) {
                l.watcher = None;
            }
            // Nobody watches (this was the watcher, or the waiter it handed the watch to left
            // with its verdict before taking it): another waiter takes the watch over, one not
            // already woken when there is one (a woken one may be about to leave too; if it
            // does, its own leaving hands the watch on).
            if l.watcher.is_none() {
                let next = match l.parked.values().any(|p| !p.woken) {
                    true => l.parked.values_mut().find(|p| !p.woken),
                    false => l.parked.values_mut().next(),
                };
                if let Some(p) = next {
                    p.woken = true;
                    if let Some(w) = p.waker.take() {
                        w.wake();
                    }
                }
            }
            if l.parked.is_empty() {
                all.remove(&self.spot);
            }
        });
    }
}

/// Wake those of `tickets` that wait on this core at `spot` (the others are another core's).
pub(super) fn wake(spot: Spot, tickets: impl Iterator<Item = u64>) {
    LOCAL.with(|all| {
        let mut all = all.borrow_mut();
        let Some(l) = all.get_mut(&spot) else {
            return;
        };
        for t in tickets {
            if let Some(p) = l.parked.get_mut(&t) {
                p.woken = true;
                if let Some(w) = p.waker.take() {
                    w.wake();
                }
            }
        }
    });
}

/// See [`Place::woken`].
pub(super) struct Woken<'a> {
    place: &'a Place,
}

impl Future for Woken<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let p = self.place;
        with(p.spot, |l| match l.parked.get_mut(&p.ticket) {
            Some(me) if me.woken => {
                me.woken = false;
                Poll::Ready(())
            }
            Some(me) => {
                if !me.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    me.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            // Not parked (cannot happen while its place is held): nothing to wait for.
            None => Poll::Ready(()),
        })
    }
}
