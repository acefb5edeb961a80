//! The gateway's waiting room while the fleet is saturated: who goes next, who is shed when it
//! is full. Pure (no clock, no locks): the caller passes the time and holds the lock.
//!
//! Order: the highest priority class first; within a class, the tenant that has received the
//! least service so far for its weight (the fairness counters of [`super::fair`]); within a
//! tenant, arrival. A full room makes space by shedding the newest waiter of the lowest class
//! below the newcomer's, else refuses the newcomer: the lowest class is shed first.

use super::fair::Fairness;
use super::TenantId;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// A priority class. Higher is served first (SGLang's default direction for its `priority`
/// field); a negative class is sheddable.
pub type Priority = i32;

/// One request waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    /// Unique per waiter; how a waiter that leaves is found.
    pub ticket: u64,
    /// Its class, already clamped to its tenant's maximum.
    pub class: Priority,
    /// Whose share it draws from.
    pub tenant: TenantId,
    /// Prompt tokens (or an estimate) charged to its tenant when it is let in.
    pub tokens: u64,
    /// Generations (prompts times `n`) charged to its tenant's request limit when let in.
    pub requests: u64,
}

/// The waiters of one class, one line per tenant.
#[derive(Debug, Default)]
struct Class {
    lines: BTreeMap<TenantId, VecDeque<Waiter>>,
    len: usize,
}

/// The waiting room of one model's fleet.
#[derive(Debug)]
pub struct WaitQueue {
    /// By class, highest first when iterated in reverse.
    classes: BTreeMap<Priority, Class>,
    /// Where each ticket waits.
    at: HashMap<u64, (Priority, TenantId)>,
    capacity: usize,
}

/// What [`WaitQueue::push`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// The newcomer waits.
    Queued,
    /// The newcomer waits and this waiter, of a lower class, was shed to make room.
    QueuedShedding(Waiter),
    /// The room is full of waiters of the newcomer's class or higher: the newcomer is refused.
    Refused,
}

impl WaitQueue {
    /// A room for at most `capacity` waiters (0: every newcomer is refused).
    pub fn new(capacity: usize) -> WaitQueue {
        WaitQueue {
            classes: BTreeMap::new(),
            at: HashMap::new(),
            capacity,
        }
    }

    /// Waiters now.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Waiters per class, highest class first (for the queue-depth gauges).
    pub fn depths(&self) -> impl Iterator<Item = (Priority, usize)> + '_ {
        self.classes.iter().rev().map(|(p, c)| (*p, c.len))
    }

    /// Waiters that would go before a newcomer of class `class` (every waiter of its class or
    /// higher): what its expected wait is estimated from.
    pub fn ahead_of(&self, class: Priority) -> usize {
        self.classes.range(class..).map(|(_, c)| c.len).sum()
    }

    /// Whether a newcomer of class `class` would go first (nobody of its class or higher waits).
    pub fn would_lead(&self, class: Priority) -> bool {
        self.ahead_of(class) == 0
    }

    /// Let `w` wait (see [`Pushed`]). A tenant whose line was empty is brought up to the
    /// least-served waiting tenant's counter, so time spent idle is not saved up as credit.
    pub fn push(&mut self, w: Waiter, fair: &mut Fairness) -> Pushed {
        let full = self.at.len() >= self.capacity;
        self.push_when(w, fair, full)
    }

    /// [`WaitQueue::push`] with the room's fullness decided by the caller (rooms that share
    /// one bound: `full` when all of them together hold it).
    pub fn push_when(&mut self, w: Waiter, fair: &mut Fairness, full: bool) -> Pushed {
        let mut shed = None;
        if full {
            let lowest = self.classes.keys().next().copied();
            match lowest {
                Some(low) if low < w.class => {
                    shed = self.pop_newest_of(low);
                }
                _ => return Pushed::Refused,
            }
            if shed.is_none() {
                return Pushed::Refused;
            }
        }
        if !self.tenant_waits(w.tenant) {
            let floor = self.least_served(fair);
            fair.lift(w.tenant, floor);
        }
        let class = self.classes.entry(w.class).or_default();
        class.lines.entry(w.tenant).or_default().push_back(w);
        class.len += 1;
        self.at.insert(w.ticket, (w.class, w.tenant));
        match shed {
            Some(s) => Pushed::QueuedShedding(s),
            None => Pushed::Queued,
        }
    }

    /// The class of the waiter [`WaitQueue::pop`] would let in next.
    pub fn head_class(&self) -> Option<Priority> {
        self.classes.keys().next_back().copied()
    }

    /// The waiter to let in next, taken out of the room (the caller charges its tokens).
    pub fn pop(&mut self, fair: &Fairness) -> Option<Waiter> {
        let (&class, c) = self.classes.iter().next_back()?;
        let tenant = c
            .lines
            .iter()
            .filter(|(_, line)| !line.is_empty())
            .min_by(|(ta, _), (tb, _)| fair.counter(**ta).total_cmp(&fair.counter(**tb)))
            .map(|(t, _)| *t)?;
        self.take(class, tenant, |line| line.pop_front())
    }

    /// Take waiter `ticket` out (it left, timed out or was let in elsewhere); None when it is
    /// not here.
    pub fn remove(&mut self, ticket: u64) -> Option<Waiter> {
        let &(class, tenant) = self.at.get(&ticket)?;
        self.take(class, tenant, |line| {
            let i = line.iter().position(|w| w.ticket == ticket)?;
            line.remove(i)
        })
    }

    fn pop_newest_of(&mut self, class: Priority) -> Option<Waiter> {
        let c = self.classes.get(&class)?;
        // The newest waiter of the class: the highest ticket among the lines' backs.
        let tenant = c
            .lines
            .iter()
            .filter_map(|(t, line)| line.back().map(|w| (*t, w.ticket)))
            .max_by_key(|(_, ticket)| *ticket)
            .map(|(t, _)| t)?;
        self.take(class, tenant, |line| line.pop_back())
    }

    fn take(
        &mut self,
        class: Priority,
        tenant: TenantId,
        from: impl FnOnce(&mut VecDeque<Waiter>) -> Option<Waiter>,
    ) -> Option<Waiter> {
        let c = self.classes.get_mut(&class)?;
        let line = c.lines.get_mut(&tenant)?;
        let w = from(line)?;
        if line.is_empty() {
            c.lines.remove(&tenant);
        }
        c.len -= 1;
        if c.len == 0 {
            self.classes.remove(&class);
        }
        self.at.remove(&w.ticket);
        Some(w)
    }

    fn tenant_waits(&self, tenant: TenantId) -> bool {
        self.classes.values().any(|c| c.lines.contains_key(&tenant))
    }

    /// The smallest fairness counter among tenants that wait (None: nobody waits).
    fn least_served(&self, fair: &Fairness) -> Option<f64> {
        self.classes
            .values()
            .flat_map(|c| c.lines.keys())
            .map(|t| fair.counter(*t))
            .min_by(f64::total_cmp)
    }
}

#[cfg(test)]
mod tests;
