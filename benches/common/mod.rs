//! Shared by the memory benches (`tree`, `tree_memory`): the gateway's allocator (mimalloc) with
//! counters of live heap bytes, so a bench can weigh a structure by dropping it and reading how
//! much the counters fell. Installed as the global allocator by `mod common;`.
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

/// mimalloc plus counters of live bytes: as requested and rounded to mimalloc's size classes.
pub struct Counting;

static REQUESTED: AtomicIsize = AtomicIsize::new(0);
static ROUNDED: AtomicIsize = AtomicIsize::new(0);

/// mimalloc's small size classes: 8-byte steps up to 64 bytes, then four classes per doubling.
fn size_class(size: usize) -> usize {
    if size <= 64 {
        return size.max(8).next_multiple_of(8);
    }
    let b = usize::BITS - 1 - (size - 1).leading_zeros();
    size.next_multiple_of(1 << (b - 2))
}

fn account(size: usize, sign: isize) {
    REQUESTED.fetch_add(sign * size as isize, Relaxed);
    ROUNDED.fetch_add(sign * size_class(size) as isize, Relaxed);
}

/// Live heap bytes now: (as requested, rounded up to mimalloc's size classes). A structure's
/// weight is the fall of both across dropping it.
pub fn live_bytes() -> (isize, isize) {
    (REQUESTED.load(Relaxed), ROUNDED.load(Relaxed))
}

// SAFETY: forwards every call unchanged to mimalloc; the counters have no effect on allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        account(l.size(), 1);
        mimalloc::MiMalloc.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        account(l.size(), 1);
        mimalloc::MiMalloc.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        account(l.size(), -1);
        mimalloc::MiMalloc.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        account(l.size(), -1);
        account(new_size, 1);
        mimalloc::MiMalloc.realloc(p, l, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;
