//! Immutable reference-counted bytes behind one thin pointer with an 8-byte header, for edge
//! text: the buffers of a tree are as many as its leaves, so the header is paid per node.
//! (`std::sync::Arc<[u8]>` costs 16 header bytes and a fat pointer; triomphe's `ThinArc`,
//! a thin pointer but a 16-byte header.)

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};

/// The allocation starts with this, the bytes follow.
#[repr(C)]
struct Header {
    count: AtomicU32,
    len: u32,
}

const HEADER: usize = std::mem::size_of::<Header>();

/// Shared immutable bytes, at most `u32::MAX` of them (never empty: an empty edge holds none).
pub(super) struct SharedBytes {
    ptr: NonNull<Header>,
}

// SAFETY: the bytes are never written after `new` returns and the count is atomic, so sharing
// and sending follow the same rules as `Arc<[u8]>`.
unsafe impl Send for SharedBytes {}
unsafe impl Sync for SharedBytes {}

fn layout(len: usize) -> Layout {
    // Cannot fail: `len` ≤ u32::MAX, far below isize::MAX, and the alignment is 4.
    Layout::from_size_align(HEADER + len, std::mem::align_of::<Header>())
        .unwrap_or_else(|_| std::process::abort())
}

impl SharedBytes {
    /// A buffer holding the concatenation of `parts`; `None` when it would be empty or longer
    /// than `u32::MAX` bytes (callers cut keys well below that).
    pub(super) fn new(parts: &[&[u8]]) -> Option<SharedBytes> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let len32 = u32::try_from(len).ok().filter(|&l| l > 0)?;
        let layout = layout(len);
        // SAFETY: the layout has a non-zero size (HEADER > 0).
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<Header>()) else {
            handle_alloc_error(layout)
        };
        // SAFETY: `raw` is a fresh allocation of HEADER + len bytes aligned for `Header`; the
        // header is written first, then exactly `len` bytes after it.
        unsafe {
            ptr.as_ptr().write(Header {
                count: AtomicU32::new(1),
                len: len32,
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

    /// The bytes.
    #[inline]
    pub(super) fn as_slice(&self) -> &[u8] {
        let len = self.header().len as usize;
        // SAFETY: `len` initialised bytes follow the header, immutable until the last drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>().add(HEADER), len) }
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
        let len = self.header().len as usize;
        // SAFETY: this was the last reference; the allocation was made with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast::<u8>(), layout(len)) };
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
        assert_eq!(b.as_slice(), b"hello world");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let d = c.clone();
                        assert_eq!(d.as_slice().len(), 11);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(b.as_slice(), b"hello world");
    }

    #[test]
    fn empty_is_none() {
        assert!(SharedBytes::new(&[]).is_none());
        assert!(SharedBytes::new(&[b"", b""]).is_none());
    }
}
