//! Leaf helpers with no dependency on any other radixgate module, so every layer (tree, route,
//! proxy) can share one implementation instead of growing its own copy.

pub mod entropy;
pub mod json_span;
pub mod memory;
pub mod priority;
pub mod recent;
pub mod rng;
pub mod text;

/// A worker's stable identity inside the gateway. Assigned once by the registry and never reused,
/// so tree entries of a removed worker can never be mistaken for a new one.
pub type WorkerId = u32;

/// Length of the common prefix of two slices (token ids, hashes), compared 64 elements at a
/// time (slice equality of plain integers is a `memcmp`), then one by one. Bytes have their
/// own, word-wise version: `text::common_byte_prefix`.
pub fn common_len<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    const CHUNK: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    #[test]
    fn common_len_counts_exactly() {
        let a: Vec<u32> = (0..500).collect();
        for cut in [0, 1, 63, 64, 65, 200, 499] {
            let mut b = a.clone();
            b[cut] = 9999;
            assert_eq!(super::common_len(&a, &b), cut);
        }
        assert_eq!(super::common_len(&a, &a[..130]), 130);
        assert_eq!(super::common_len(&a, &a), 500);
    }
}
