//! Reference-counted bytes behind one thin pointer with a 12-byte header, for edge text: the
//! buffers of a tree are as many as its leaves, so the header is paid per node.
//! (`std::sync::Arc<[u8]>` costs 16 header bytes and a fat pointer; triomphe's `ThinArc`,
//! a thin pointer but a 16-byte header.)
//!
//! A buffer may have room after its bytes. Bytes once written never change; the writer may
//! append after the last of them ([`SharedBytes::try_append`]), so a leaf whose conversation
//! grows by a turn extends its edge in place instead of copying the whole edge into a new
//! buffer (at 100k inserts/s of growing chat prompts those copies, their allocations and the
//! page faults behind them were most of the writer's time). An edge is a range of bytes
//! written before it was made, so a reader of a published node never reads bytes being written.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};

/// The allocation starts with this, the bytes follow.
#[repr(C)]
struct Header {
    count: AtomicU32,
    /// Bytes written (and claimed: an append claims its range before writing it).
    len: AtomicU32,
    /// Bytes the allocation holds after the header.
    cap: u32,
}

const HEADER: usize = std::mem::size_of::<Header>();

/// Shared bytes, at most `u32::MAX` of them (never empty: an empty edge holds none).
pub(super) struct SharedBytes {
    ptr: NonNull<Header>,
}

// SAFETY: written bytes are never written again, appends write only bytes no other owner has
// claimed (the claim is atomic), and the count is atomic, so sharing and sending follow the
// same rules as `Arc<[u8]>`.
unsafe impl Send for SharedBytes {}
unsafe impl Sync for SharedBytes {}

fn layout(cap: usize) -> Layout {
    // Cannot fail: `cap` ≤ u32::MAX, far below isize::MAX, and the alignment is 4.
    Layout::from_size_align(HEADER + cap, std::mem::align_of::<Header>())
        .unwrap_or_else(|_| std::process::abort())
}

impl SharedBytes {
    /// A buffer holding exactly the concatenation of `parts`; `None` when it would be empty or
    /// longer than `u32::MAX` bytes (callers cut keys well below that).
    pub(super) fn new(parts: &[&[u8]]) -> Option<SharedBytes> {
        Self::with_room(parts, 0)
    }

    /// A buffer holding the concatenation of `parts` with room for `room` more bytes (less
    /// when the total would pass `u32::MAX`).
    pub(super) fn with_room(parts: &[&[u8]], room: usize) -> Option<SharedBytes> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let len32 = u32::try_from(len).ok().filter(|&l| l > 0)?;
        let cap32 = u32::try_from(len.saturating_add(room)).unwrap_or(u32::MAX);
        let layout = layout(cap32 as usize);
        // SAFETY: the layout has a non-zero size (HEADER > 0).
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<Header>()) else {
            handle_alloc_error(layout)
        };
        // SAFETY: `raw` is a fresh allocation of HEADER + cap bytes aligned for `Header`; the
        // header is written first, then exactly `len` ≤ cap bytes after it.
        unsafe {
            ptr.as_ptr().write(Header {
                count: AtomicU32::new(1),
                len: AtomicU32::new(len32),
                cap: cap32,
            });
            let mut at = raw.add(HEADER);
            for p in parts {
                std::ptr::copy_nonoverlapping(p.as_ptr(), at, p.len());
                at = at.add(p.len());
            }
        }
        Some(SharedBytes { ptr })
    }

    #[inline]
    fn header(&self) -> &Header {
        // SAFETY: the header lives as long as any `SharedBytes` pointing at it.
        unsafe { self.ptr.as_ref() }
    }

    /// `len` bytes at `start`: a range this owner got from [`SharedBytes::new`],
    /// [`SharedBytes::with_room`] or a successful [`SharedBytes::try_append`] (or part of one),
    /// so written before it was handed out. Empty if the range is not inside the allocation.
    #[inline]
    pub(super) fn range(&self, start: usize, len: usize) -> &[u8] {
        if start.saturating_add(len) > self.header().cap as usize {
            return &[];
        }
        // SAFETY: inside the allocation (checked above); the range was written before the
        // edge holding it was made, and bytes once written are never written again.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>().add(HEADER + start), len)
        }
    }

    /// Bytes written so far (appends may add more).
    pub(super) fn written(&self) -> usize {
        self.header().len.load(Ordering::Acquire) as usize
    }

    /// Bytes the allocation holds (written or not).
    #[inline]
    pub(super) fn capacity(&self) -> usize {
        self.header().cap as usize
    }

    /// Appends `more` right after byte `at` when `at` is where the written bytes end and the
    /// room suffices; `false` otherwise (nothing written). The range is claimed atomically
    /// first, so of two owners appending at the same place (two clones of a tree) one wins and
    /// the other makes a new buffer.
    pub(super) fn try_append(&self, at: usize, more: &[u8]) -> bool {
        let h = self.header();
        let Some(end) = at.checked_add(more.len()).filter(|&e| e <= h.cap as usize) else {
            return false;
        };
        let (Ok(at32), Ok(end32)) = (u32::try_from(at), u32::try_from(end)) else {
            return false;
        };
        if h.len
            .compare_exchange(at32, end32, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // SAFETY: [at, end) is inside the allocation (end ≤ cap), was never written (it
        // starts where the written bytes ended) and is now claimed by this call alone.
        unsafe {
            std::ptr::copy_nonoverlapping(
                more.as_ptr(),
                self.ptr.as_ptr().cast::<u8>().add(HEADER + at),
                more.len(),
            );
        }
        true
    }

    /// The buffer's address, to tell buffers apart.
    #[inline]
    pub(super) fn id(&self) -> *const u8 {
        self.ptr.as_ptr().cast::<u8>().cast_const()
    }
}

impl Clone for SharedBytes {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed as in `Arc::clone`: a new reference is made from an existing one.
        let old = self.header().count.fetch_add(1, Ordering::Relaxed);
        if old > u32::MAX / 2 {
            // Tree nodes and snapshots hold the references: billions of them cannot exist,
            // so this is corruption; stop before the count could wrap.
            std::process::abort();
        }
        SharedBytes { ptr: self.ptr }
    }
}

impl Drop for SharedBytes {
    fn drop(&mut self) {
        if self.header().count.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        // Every other owner's uses happen before the free (as in `Arc::drop`).
        fence(Ordering::Acquire);
        let cap = self.header().cap as usize;
        // SAFETY: this was the last reference; the allocation was made with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast::<u8>(), layout(cap)) };
    }
}

#[cfg(test)]
mod tests {
    use super::SharedBytes;

    #[test]
    fn holds_the_concatenation_and_lives_until_the_last_clone() {
        let a = SharedBytes::new(&[b"hello ", b"", b"world"]).unwrap();
        let b = a.clone();
        assert_eq!(a.id(), b.id());
        drop(a);
        assert_eq!(b.range(0, 11), b"hello world");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let d = c.clone();
                        assert_eq!(d.range(0, d.written()), b"hello world");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(b.range(0, 11), b"hello world");
    }

    #[test]
    fn appends_only_where_the_written_bytes_end_and_only_within_the_room() {
        let a = SharedBytes::with_room(&[b"abc"], 4).unwrap();
        assert_eq!((a.written(), a.capacity()), (3, 7));
        assert!(!a.try_append(2, b"x"), "inside the written bytes");
        assert!(a.try_append(3, b"de"));
        assert!(
            !a.try_append(3, b"zz"),
            "a second owner at the old end loses"
        );
        assert!(!a.try_append(5, b"fgh"), "past the room");
        assert!(a.try_append(5, b"fg"));
        assert_eq!(a.range(0, 7), b"abcdefg");
        assert_eq!(a.range(5, 3), b"", "a range past the allocation is empty");
        let full = SharedBytes::new(&[b"abc"]).unwrap();
        assert!(!full.try_append(3, b"d"));
        assert!(full.try_append(3, b""));
    }

    #[test]
    fn racing_appends_claim_disjoint_ranges() {
        let a = SharedBytes::with_room(&[b"0"], 4000).unwrap();
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for _ in 0..200 {
                        let at = a.written();
                        if a.try_append(at, &[b'a' + t; 4]) {
                            mine.push(at);
                        }
                    }
                    mine
                })
            })
            .collect();
        for (t, th) in threads.into_iter().enumerate() {
            for at in th.join().unwrap() {
                assert_eq!(a.range(at, 4), &[b'a' + t as u8; 4]);
            }
        }
    }

    #[test]
    fn empty_is_none() {
        assert!(SharedBytes::new(&[]).is_none());
        assert!(SharedBytes::new(&[b"", b""]).is_none());
    }
}
