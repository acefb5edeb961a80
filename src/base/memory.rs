//! Handing freed memory back to the OS at a moment the caller chooses.
//!
//! The allocator (mimalloc) keeps freed pages for reuse and returns them after a delay. Where a
//! peer can make the gateway allocate and free its largest buffers back to back (KV-event
//! messages of 32 MiB), the next one is allocated before the last is returned and resident
//! memory grows to several of them; returning the pages after each such buffer keeps it at one.

/// Return the pages the allocator holds free to the OS. Costs a walk of the allocator's
/// arenas: call it after letting go of a large buffer, not per request.
pub fn return_freed_pages() {
    // SAFETY: `mi_collect` takes no pointer and may be called from any thread at any time; it
    // only frees pages that no allocation uses (mimalloc's documented contract).
    unsafe { libmimalloc_sys::mi_collect(true) }
}
