//! A cap on calls of one kind in flight across the whole gateway, for public endpoints that make
//! the gateway call workers on a client's behalf (`/v1/models` asks every worker, and
//! `/health_generate` makes one generate): without it one client looping on them multiplies
//! into work for the whole fleet. A call over the cap is answered 503 at once, never queued.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Calls in flight of one kind, at most `max`.
#[derive(Debug)]
pub struct CallLimit {
    max: usize,
    now: AtomicUsize,
}

/// One call's place; given back on drop.
#[derive(Debug)]
pub struct CallSlot<'a>(&'a CallLimit);

impl Drop for CallSlot<'_> {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CallLimit {
    /// At most `max` calls at once.
    pub fn new(max: usize) -> CallLimit {
        CallLimit {
            max,
            now: AtomicUsize::new(0),
        }
    }

    /// A place, or `None` when `max` calls are in flight.
    pub fn try_take(&self) -> Option<CallSlot<'_>> {
        self.now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| CallSlot(self))
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.now.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_max_and_given_back() {
        let l = CallLimit::new(2);
        let a = l.try_take();
        let b = l.try_take();
        assert!(a.is_some() && b.is_some());
        assert!(l.try_take().is_none());
        drop(a);
        assert_eq!(l.in_flight(), 1);
        assert!(l.try_take().is_some());
        drop(b);
        assert_eq!(l.in_flight(), 0);
    }
}
