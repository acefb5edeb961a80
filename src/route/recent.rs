//! What was routed since the last tree snapshot was published. The tree reaches the cores
//! through snapshots published every ~1 ms (later when the writer thread is starved of CPU), so
//! in a burst — a thousand prompts sharing system prompts arriving at once — requests right
//! behind the first of a group would not see where it went and would scatter; the reference,
//! which inserts into one shared locked tree, does see it. So every insert is also written into
//! this small lock-free ring shared by all cores until the writer has published it, and routing
//! matches against it too. Pure: epochs are passed in.
//!
//! Memory: each slot holds one text of at most `MAX_ROUTING_TEXT` bytes that the core copied out
//! of the request body when the body was much larger (never a slice pinning a whole upload), and
//! a slot whose entry has expired is emptied by the next lookup that passes it, or by
//! [`RecentInserts::sweep`] (each core's housekeeping, every half second).
//!
//! Cost: a lookup reads one atomic when nothing was inserted within the last two publications
//! (the steady state: repeated prompts send no insert at all), and otherwise one plain atomic
//! per slot, loading (arc-swap) only the slots whose epoch is still live.

use crate::base::text::SharedText;
use crate::base::text::{char_count, common_prefix};
use crate::base::WorkerId;
use crate::tree::TreeKey;
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Slots in the ring; a burst larger than this within one publication falls back to the
/// snapshot for the oldest entries. Only entries of the last two publications are compared
/// (older ones are skipped on their epoch), so the scan costs in proportion to the burst, not to
/// the capacity: 256 covers a 1,024-prompt burst on a CPU-starved writer (gsp: 64 misses, the
/// minimum, instead of 79–98 with 64 slots).
pub const CAPACITY: usize = 256;

// The scan walks back from the push counter modulo CAPACITY, which stays in step with the
// counter only when CAPACITY divides its wrap-around.
const _: () = assert!(CAPACITY.is_power_of_two());

/// Entries count for this many snapshot publications after their insert (the writer applies an
/// insert before the publication that follows it; one more covers a publication in flight).
const KEEP_EPOCHS: u64 = 2;

/// Offsets of the words kept beside each slot: the 8 bytes ending at 64 · 2^k bytes of the
/// entry's text, k = 0 … 13 (64 B … 512 KiB).
const SAMPLES: usize = 14;

/// End of the `k`-th sampled word.
const fn sample_end(k: usize) -> usize {
    64 << k
}

/// What a lookup reads of a slot before it touches the entry: the text's length and sampled
/// words of it, in the ring's own memory. An entry can only beat a floor `f` if it agrees with
/// the request on bytes `..=f`, so on the sampled word that ends at or before `f + 1`; checking
/// that word here passes over, without a cache miss on their texts, the live entries of other
/// conversations (each compared at the floor was one miss: 62 % of the scan's time at 16 KiB
/// conversations). Only a hint, like the epoch: a lookup racing a push into the same slot may
/// read the new sketch beside the old entry (or a mix of both) and pass over that slot, as if
/// it had looked before the push or after it; the entry it would have seen is the one the push
/// is replacing, or the push itself, and the snapshot soon holds either.
#[derive(Debug)]
struct Sketch {
    len: AtomicUsize,
    words: [AtomicU64; SAMPLES],
}

impl Sketch {
    fn empty() -> Self {
        Sketch {
            len: AtomicUsize::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn write(&self, text: &[u8]) {
        self.len.store(text.len(), Ordering::Relaxed);
        for (k, w) in self.words.iter().enumerate() {
            if let Some(word) = word_ending_at(text, sample_end(k)) {
                w.store(word, Ordering::Relaxed);
            }
        }
    }

    /// Whether the entry sketched here may match `key` over more than `floor` bytes.
    #[inline]
    fn may_beat(&self, key: &[u8], floor: usize) -> bool {
        if self.len.load(Ordering::Relaxed) <= floor {
            return false;
        }
        // The last sampled word that ends within `..=floor`.
        let within = floor + 1;
        if within < sample_end(0) {
            return true;
        }
        let k = ((within / sample_end(0)).ilog2() as usize).min(SAMPLES - 1);
        match word_ending_at(key, sample_end(k)) {
            Some(word) => self.words[k].load(Ordering::Relaxed) == word,
            None => true,
        }
    }
}

/// The 8 bytes of `text` ending at `end`, as a word (`None` when `text` is shorter).
#[inline]
fn word_ending_at(text: &[u8], end: usize) -> Option<u64> {
    let bytes = text.get(end.checked_sub(8)?..end)?.first_chunk::<8>()?;
    Some(u64::from_le_bytes(*bytes))
}

#[derive(Debug)]
struct Entry {
    tree: TreeKey,
    text: SharedText,
    worker: WorkerId,
    epoch: u64,
}

/// The longest match found among recent inserts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecentMatch {
    pub matched_chars: usize,
    /// The same prefix in bytes (a character boundary of the request's text).
    pub matched_bytes: usize,
    pub worker: WorkerId,
}

/// One request's view of the ring: which tree and which snapshot it routes against. The policy
/// asks it only when it measures the prompt's match, and only for what beats the snapshot's.
#[derive(Debug, Clone, Copy)]
pub struct RecentProbe<'a> {
    /// The ring every core pushes into.
    pub ring: &'a RecentInserts,
    /// The model's tree the request routes in: entries of other trees never match.
    pub tree: TreeKey,
    /// The snapshot the request routes against: entries it may already show still count for
    /// a publication or two, older ones not at all.
    pub epoch: u64,
}

impl RecentProbe<'_> {
    /// The longest unpublished insert matching more than `floor` bytes of `text`.
    pub fn beyond(&self, text: &str, floor: usize) -> Option<RecentMatch> {
        self.ring.longest_beyond(self.tree, text, self.epoch, floor)
    }
}

/// A ring of unpublished inserts, written and read by every core without locks.
#[derive(Debug)]
pub struct RecentInserts {
    slots: Box<[ArcSwapOption<Entry>]>,
    /// Each slot's epoch + 1 (0: empty), beside the slot so a lookup skips dead slots without
    /// an arc-swap load. Only a hint: the entry itself is checked again once loaded.
    epochs: Box<[AtomicU64]>,
    /// Each slot's [`Sketch`], written before its epoch hint.
    sketches: Box<[Sketch]>,
    /// The latest epoch + 1 any push was made at (0: none yet): when even it has expired, no
    /// slot can count and a lookup returns at once.
    newest: AtomicU64,
    next: AtomicUsize,
}

impl Default for RecentInserts {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes checked at the end of the current best match before an entry is compared whole.
const PROBE: usize = 8;

/// Whether `text`'s common prefix with `key` can be longer than `floor` bytes: only if the two
/// agree on every byte up to and including byte `floor`, so the last [`PROBE`] of those are
/// checked first. Exact (never skips an entry that would win), and cheap where it matters: in a
/// burst of conversations sharing a system prompt, once one entry matched a whole conversation
/// the others differ right there and are skipped instead of compared over the shared prompt
/// (at 16 KiB conversations that compare was 17 % of a core's time).
fn may_beat(key: &[u8], text: &[u8], floor: usize) -> bool {
    if floor == 0 {
        return true;
    }
    let end = floor + 1;
    let (Some(k), Some(t)) = (key.get(..end), text.get(..end)) else {
        return false;
    };
    let from = end.saturating_sub(PROBE);
    match (
        k[from..].first_chunk::<PROBE>(),
        t[from..].first_chunk::<PROBE>(),
    ) {
        // One word compare, inlined (a slice compare of unknown length calls `memcmp`).
        (Some(a), Some(b)) => a == b,
        _ => k[from..] == t[from..],
    }
}

impl RecentInserts {
    /// An empty ring.
    pub fn new() -> Self {
        RecentInserts {
            slots: (0..CAPACITY).map(|_| ArcSwapOption::empty()).collect(),
            epochs: (0..CAPACITY).map(|_| AtomicU64::new(0)).collect(),
            sketches: (0..CAPACITY).map(|_| Sketch::empty()).collect(),
            newest: AtomicU64::new(0),
            next: AtomicUsize::new(0),
        }
    }

    /// Remember an insert into `tree` made while the published snapshot was at `epoch`.
    pub fn push(&self, tree: TreeKey, text: SharedText, worker: WorkerId, epoch: u64) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % CAPACITY;
        self.sketches[i].write(text.as_bytes());
        self.slots[i].store(Some(Arc::new(Entry {
            tree,
            text,
            worker,
            epoch,
        })));
        // After the store: a reader that sees the hint finds the entry (or a newer one).
        self.epochs[i].store(epoch + 1, Ordering::Release);
        self.newest.fetch_max(epoch + 1, Ordering::Release);
    }

    /// Whether an entry pushed at `epoch + 1 == hint` may still count at `now` (0: empty).
    fn may_count(hint: u64, now: u64) -> bool {
        hint != 0 && hint - 1 + KEEP_EPOCHS > now
    }

    /// Empty every slot whose entry no longer counts at `epoch`, so the texts of a burst are
    /// freed even when no lookup passes them (lookups stop scanning once all have expired).
    pub fn sweep(&self, epoch: u64) {
        for (slot, hint) in self.slots.iter().zip(self.epochs.iter()) {
            let h = hint.load(Ordering::Acquire);
            if h != 0 && !Self::may_count(h, epoch) {
                let guard = slot.load();
                if guard
                    .as_ref()
                    .is_some_and(|e| e.epoch + KEEP_EPOCHS <= epoch)
                {
                    let _ = slot.compare_and_swap(&guard, None);
                }
            }
        }
    }

    /// Forget a worker (removed, or refusing connections).
    pub fn forget_worker(&self, worker: WorkerId) {
        for slot in self.slots.iter() {
            if slot.load().as_ref().is_some_and(|e| e.worker == worker) {
                slot.store(None);
            }
        }
    }

    /// The longest prefix of `text` among inserts the snapshot at `epoch` may not show yet, for
    /// the same tree; `None` when nothing matches. Expired entries met on the way are dropped
    /// (unless a core replaced them meanwhile), so their text does not linger.
    pub fn longest(&self, tree: TreeKey, text: &str, epoch: u64) -> Option<RecentMatch> {
        self.longest_beyond(tree, text, epoch, 0)
    }

    /// [`longest`](Self::longest) among the entries that match more than `floor` bytes of
    /// `text` (`None` when none does). The router passes the snapshot's own match as `floor`:
    /// an entry can only change the decision by beating it, and with the floor set every other
    /// entry is passed over on [`PROBE`] bytes instead of compared over the prefix they share
    /// with the request (a burst of conversations behind one system prompt: at 16 KiB, 7 % of a
    /// core's time went to comparing them over that prompt).
    pub fn longest_beyond(
        &self,
        tree: TreeKey,
        text: &str,
        epoch: u64,
        floor: usize,
    ) -> Option<RecentMatch> {
        if !Self::may_count(self.newest.load(Ordering::Acquire), epoch) {
            return None;
        }
        let key = text.as_bytes();
        if floor >= key.len() {
            return None; // nothing can match more than all of it
        }
        let mut floor = floor;
        let mut best: Option<WorkerId> = None;
        // Newest first: a conversation's latest turn extends its earlier ones, so once it set
        // the floor the older turns still in the ring fail `may_beat` (too short) instead of
        // each being compared whole.
        let newest = self.next.load(Ordering::Acquire);
        for back in 1..=CAPACITY {
            let i = newest.wrapping_sub(back) % CAPACITY;
            let (slot, hint) = (&self.slots[i], &self.epochs[i]);
            if !Self::may_count(hint.load(Ordering::Acquire), epoch) {
                continue; // empty, or expired: `sweep` frees it
            }
            if !self.sketches[i].may_beat(key, floor) {
                continue;
            }
            let guard = slot.load();
            let Some(e) = guard.as_ref() else { continue };
            if e.epoch + KEEP_EPOCHS <= epoch {
                let _ = slot.compare_and_swap(&guard, None);
                continue;
            }
            if e.tree != tree || !may_beat(key, e.text.as_bytes(), floor) {
                continue;
            }
            let n = common_prefix(key, e.text.as_bytes());
            if n > floor {
                floor = n;
                best = Some(e.worker);
            }
        }
        best.map(|worker| RecentMatch {
            matched_chars: char_count(&key[..floor]),
            matched_bytes: floor,
            worker,
        })
    }

    /// Entries that still count at `epoch`.
    pub fn live(&self, epoch: u64) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.load()
                    .as_ref()
                    .is_some_and(|e| e.epoch + KEEP_EPOCHS > epoch)
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> SharedText {
        SharedText::copy_of(s)
    }

    #[test]
    fn finds_the_longest_recent_prefix_of_the_same_model() {
        let r = RecentInserts::new();
        r.push(TreeKey::Default, b("system prompt A question 1"), 1, 10);
        r.push(TreeKey::Default, b("system prompt B"), 2, 10);
        r.push(
            TreeKey::Served("m"),
            b("system prompt A question 1 and more"),
            3,
            10,
        );
        let m = r
            .longest(TreeKey::Default, "system prompt A question 2", 10)
            .unwrap();
        assert_eq!(
            m,
            RecentMatch {
                matched_chars: "system prompt A question ".len(),
                matched_bytes: "system prompt A question ".len(),
                worker: 1
            }
        );
        assert_eq!(
            r.longest(TreeKey::Served("m"), "system prompt A question 1 and", 10)
                .unwrap()
                .worker,
            3
        );
        assert!(r.longest(TreeKey::Shared, "system", 10).is_none());
        assert!(r.longest(TreeKey::Default, "zzz", 10).is_none());
    }

    #[test]
    fn entries_expire_once_published_and_capacity_is_bounded() {
        let r = RecentInserts::new();
        r.push(TreeKey::Default, b("abc"), 1, 5);
        assert!(r.longest(TreeKey::Default, "abc", 6).is_some());
        assert!(r.longest(TreeKey::Default, "abc", 7).is_none());
        assert_eq!(r.live(7), 0);
        // The expired entry's slot is emptied by the sweep: its text is freed.
        r.sweep(7);
        assert!(r.slots.iter().all(|s| s.load().is_none()));
        let n = CAPACITY as u32 + 100;
        for i in 0..n {
            r.push(TreeKey::Default, b(&format!("text {i}")), i, 0);
        }
        assert_eq!(r.live(0), CAPACITY);
        assert_eq!(
            r.longest(TreeKey::Default, &format!("text {}", n - 1), 0)
                .unwrap()
                .worker,
            n - 1
        );
        assert_eq!(
            r.longest(TreeKey::Default, "text 5", 0)
                .map(|m| m.matched_chars),
            Some("text ".len())
        );
    }

    #[test]
    fn matches_never_split_a_character_and_workers_can_be_forgotten() {
        let r = RecentInserts::new();
        r.push(TreeKey::Default, b("naïve é"), 4, 0);
        // 'é' (C3 A9) vs 'è' (C3 A8) share their first byte: the match stops before it.
        assert_eq!(
            r.longest(TreeKey::Default, "naïve è", 0)
                .unwrap()
                .matched_chars,
            "naïve ".chars().count()
        );
        r.forget_worker(4);
        assert!(r.longest(TreeKey::Default, "naïve", 0).is_none());
    }

    #[test]
    fn once_every_entry_expired_lookups_return_at_once_and_the_sweep_frees_the_texts() {
        let r = RecentInserts::new();
        assert!(r.longest(TreeKey::Default, "abc", 0).is_none());
        r.push(TreeKey::Default, b("abc"), 1, 5);
        r.push(TreeKey::Default, b("abd"), 2, 6);
        assert_eq!(r.longest(TreeKey::Default, "abd", 7).unwrap().worker, 2);
        // Epoch 8: both expired; the lookup does not even look at the slots.
        assert!(r.longest(TreeKey::Default, "abd", 8).is_none());
        assert_eq!(r.slots.iter().filter(|s| s.load().is_some()).count(), 2);
        r.sweep(7);
        assert_eq!(
            r.slots.iter().filter(|s| s.load().is_some()).count(),
            1,
            "the entry of epoch 6 still counts at 7"
        );
        r.sweep(8);
        assert!(r.slots.iter().all(|s| s.load().is_none()));
        // A new push counts again.
        r.push(TreeKey::Default, b("abz"), 3, 8);
        assert_eq!(r.longest(TreeKey::Default, "abz", 8).unwrap().worker, 3);
    }

    #[test]
    fn cores_see_each_others_inserts() {
        let r = Arc::new(RecentInserts::new());
        let w = r.clone();
        std::thread::spawn(move || w.push(TreeKey::Default, b("shared system prompt"), 9, 3))
            .join()
            .unwrap();
        assert_eq!(
            r.longest(TreeKey::Default, "shared system prompt, question", 3)
                .unwrap()
                .worker,
            9
        );
    }

    /// The same over long texts that share long prefixes, where the sampled words beside each
    /// slot decide (a sample ends every power of two from 64 bytes).
    #[test]
    fn the_sampled_words_never_pass_over_an_entry_that_would_win() {
        let base: String = (0..6000).map(|i| (b'a' + (i % 23) as u8) as char).collect();
        proptest::proptest!(|(
            cuts in proptest::collection::vec((0usize..6000, "[xyé]{0,3}"), 1..40),
            key_cut in 0usize..6000,
            key_tail in "[xyé]{0,3}",
            floor_cut in 0usize..6100,
        )| {
            let r = RecentInserts::new();
            let texts: Vec<String> = cuts
                .iter()
                .map(|(cut, tail)| format!("{}{tail}", &base[..*cut]))
                .collect();
            for (i, t) in texts.iter().enumerate() {
                r.push(TreeKey::Default, b(t), i as u32, 0);
            }
            let key = format!("{}{key_tail}", &base[..key_cut]);
            let floor = floor_cut.min(key.len());
            let mut want: Option<(usize, WorkerId)> = None;
            for (i, t) in texts.iter().enumerate().rev() {
                let n = common_prefix(key.as_bytes(), t.as_bytes());
                if n > floor && want.is_none_or(|(b, _)| n > b) {
                    want = Some((n, i as u32));
                }
            }
            let got = r.longest_beyond(TreeKey::Default, &key, 0, floor);
            proptest::prop_assert_eq!(got.map(|m| (m.matched_bytes, m.worker)), want);
        });
    }

    /// The filter that skips entries before comparing them whole never changes the answer: the
    /// longest prefix beyond the floor (the newest of equals) is what comparing every entry
    /// still in the ring finds, also once pushes wrapped around it.
    #[test]
    fn skipping_entries_that_cannot_win_finds_what_comparing_all_finds() {
        proptest::proptest!(|(
            texts in proptest::collection::vec("(ab|abc|é|x){0,12}", 1..300),
            key in "(ab|abc|é|x){0,12}",
            floor_cut in 0usize..40,
        )| {
            let r = RecentInserts::new();
            for (i, t) in texts.iter().enumerate() {
                r.push(TreeKey::Default, b(t), i as u32, 0);
            }
            let floor = floor_cut.min(key.len());
            let mut want: Option<(usize, WorkerId)> = None;
            let kept = texts.len().saturating_sub(CAPACITY);
            for (i, t) in texts.iter().enumerate().skip(kept).rev() {
                let n = common_prefix(key.as_bytes(), t.as_bytes());
                if n > floor && want.is_none_or(|(b, _)| n > b) {
                    want = Some((n, i as u32));
                }
            }
            let got = r.longest_beyond(TreeKey::Default, &key, 0, floor);
            proptest::prop_assert_eq!(got.map(|m| (m.matched_bytes, m.worker)), want);
        });
    }
}
