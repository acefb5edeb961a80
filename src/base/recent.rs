//! The few prompts a core remembers, most recent first: which of them a new prompt is compared
//! with, and which one it then overwrites. One policy for every per-core memo (block chains,
//! rendered texts), so they age and bound their entries alike.

/// At most `cap` entries, most recently claimed first.
#[derive(Debug)]
pub struct RecentSlots<E> {
    entries: Vec<E>,
    cap: usize,
}

impl<E: Default> RecentSlots<E> {
    /// An empty list of at most `cap` entries (at least one).
    pub fn new(cap: usize) -> Self {
        RecentSlots {
            entries: Vec::new(),
            cap: cap.max(1),
        }
    }

    /// The entry at `slot` (0 = most recent).
    pub fn get(&self, slot: usize) -> &E {
        &self.entries[slot]
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every entry, most recent first.
    pub fn iter(&self) -> std::slice::Iter<'_, E> {
        self.entries.iter()
    }

    /// The best match among the first `max_scans` entries `eligible` lets through (a cheap
    /// check before a costly scan, so many similar entries cannot each cost a scan): `score`
    /// rates one as `(rank, what it offers)` or `None`; the highest rank wins, the most recent on
    /// ties.
    pub fn best<T>(
        &self,
        max_scans: usize,
        mut eligible: impl FnMut(&E) -> bool,
        mut score: impl FnMut(usize, &E) -> Option<(usize, T)>,
    ) -> Option<T> {
        let mut best: Option<(usize, T)> = None;
        let candidates = self.entries.iter().enumerate();
        for (slot, e) in candidates.filter(|(_, e)| eligible(e)).take(max_scans) {
            if let Some((rank, t)) = score(slot, e) {
                if best.as_ref().is_none_or(|(r, _)| rank > *r) {
                    best = Some((rank, t));
                }
            }
        }
        best.map(|(_, t)| t)
    }

    /// The entry a new prompt is remembered in, moved to the front: `reused` (the entry it took
    /// from, with the length they share) when it shares at least half of that entry's `len`
    /// (the next turn, a retry: it supersedes it), else a new entry under the cap, else the
    /// least recent. Also says whether it is the reused entry (its contents still valid).
    pub fn claim(
        &mut self,
        reused: Option<(usize, usize)>,
        len: impl Fn(&E) -> usize,
    ) -> (&mut E, bool) {
        let (slot, kept) = match reused {
            Some((slot, common)) if common * 2 >= len(&self.entries[slot]) => (slot, true),
            _ if self.entries.len() < self.cap => {
                self.entries.push(E::default());
                (self.entries.len() - 1, false)
            }
            _ => (self.entries.len() - 1, false),
        };
        self.entries[..=slot].rotate_right(1);
        (&mut self.entries[0], kept)
    }
}

#[cfg(test)]
mod tests {
    use super::RecentSlots;

    #[test]
    fn claims_supersede_fill_then_reuse_the_least_recent() {
        let mut r: RecentSlots<u32> = RecentSlots::new(3);
        for v in [10, 20, 30] {
            let (e, kept) = r.claim(None, |_| 0);
            assert!(!kept);
            *e = v;
        }
        assert_eq!(r.iter().copied().collect::<Vec<_>>(), [30, 20, 10]);
        // Full: the least recent (10) goes.
        *r.claim(None, |_| 0).0 = 40;
        assert_eq!(r.iter().copied().collect::<Vec<_>>(), [40, 30, 20]);
        // Sharing half of slot 2 (20, "length" 20): superseded, moved to the front.
        let (e, kept) = r.claim(Some((2, 10)), |&v| v as usize);
        assert!(kept);
        assert_eq!(*e, 20);
        // Sharing less than half: not superseded, the least recent (30) goes.
        let (_, kept) = r.claim(Some((0, 9)), |&v| v as usize);
        assert!(!kept);
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn best_scans_the_most_recent_eligible_and_keeps_the_first_of_a_tie() {
        let mut r: RecentSlots<u32> = RecentSlots::new(8);
        for v in [5, 7, 7, 2, 9] {
            *r.claim(None, |_| 0).0 = v; // front to back: 9 2 7 7 5
        }
        let odd = |v: &u32| v % 2 == 1;
        // The first three odd entries (9, 7, 7) are scanned; 5 is not.
        let got = r.best(3, odd, |slot, &v| {
            Some((usize::from(v != 9) * v as usize, slot))
        });
        assert_eq!(got, Some(2)); // the first 7 (slot 2), not the second (slot 3)
        assert_eq!(r.best(8, |_| false, |_, _| Some((1, ()))), None);
        assert_eq!(r.best(8, odd, |_, _| None::<(usize, ())>), None);
    }
}
