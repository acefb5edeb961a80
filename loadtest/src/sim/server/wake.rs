//! Single-thread wake primitives (everything runs on one monoio thread) and the per-request
//! result slot that response tasks wait on.

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Poll, Waker};

use crate::sim::engine::FinishInfo;

/// A one-shot broadcast: once set, every current and future waiter completes. Used for "this
/// server is shutting down / died".
#[derive(Default)]
pub(super) struct LocalEvent {
    set: Cell<bool>,
    waiters: RefCell<Vec<Option<Waker>>>,
    free: RefCell<Vec<usize>>,
}

impl LocalEvent {
    pub(super) fn is_set(&self) -> bool {
        self.set.get()
    }

    pub(super) fn set(&self) {
        self.set.set(true);
        for w in self.waiters.borrow_mut().iter_mut() {
            if let Some(w) = w.take() {
                w.wake();
            }
        }
    }

    pub(super) fn wait(&self) -> EventWait<'_> {
        EventWait {
            ev: self,
            key: None,
        }
    }
}

/// Future of [`LocalEvent::wait`]; its waker slot is released on drop.
pub(super) struct EventWait<'a> {
    ev: &'a LocalEvent,
    key: Option<usize>,
}

impl Future for EventWait<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if self.ev.is_set() {
            return Poll::Ready(());
        }
        let mut waiters = self.ev.waiters.borrow_mut();
        match self.key {
            Some(k) => waiters[k] = Some(cx.waker().clone()),
            None => {
                let k = match self.ev.free.borrow_mut().pop() {
                    Some(k) => {
                        waiters[k] = Some(cx.waker().clone());
                        k
                    }
                    None => {
                        waiters.push(Some(cx.waker().clone()));
                        waiters.len() - 1
                    }
                };
                drop(waiters);
                self.key = Some(k);
            }
        }
        Poll::Pending
    }
}

impl Drop for EventWait<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key {
            if let Some(slot) = self.ev.waiters.borrow_mut().get_mut(k) {
                *slot = None;
            }
            self.ev.free.borrow_mut().push(k);
        }
    }
}

/// A single-waiter notification with a sticky flag (the GPU task's "work arrived").
#[derive(Default)]
pub(super) struct LocalNotify {
    flag: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl LocalNotify {
    pub(super) fn notify(&self) {
        self.flag.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    pub(super) async fn wait(&self) {
        poll_fn(|cx| {
            if self.flag.replace(false) {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// What a response task knows about its request; filled by the GPU task.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) tokens: RefCell<Vec<u32>>,
    /// Virtual time of the latest token.
    pub(super) last_at: Cell<f64>,
    pub(super) cached: Cell<usize>,
    pub(super) finish: Cell<Option<FinishInfo>>,
    /// Refused while queued, to make way for a higher-priority request (`--max-queued-requests`
    /// under priority scheduling): its client gets SGLang's 503.
    pub(super) queue_full: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Slot {
    pub(super) fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Resolves once there are more than `seen` tokens or the request finished.
    pub(super) async fn changed(&self, seen: usize) {
        poll_fn(|cx| {
            if self.tokens.borrow().len() > seen
                || self.finish.get().is_some()
                || self.queue_full.get()
            {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}
