//! Leaf helpers with no dependency on any other radixgate module, so every layer (tree, route,
//! proxy) can share one implementation instead of growing its own copy.

pub mod priority;
pub mod rng;
pub mod text;

/// A worker's stable identity inside the gateway. Assigned once by the registry and never reused,
/// so tree entries of a removed worker can never be mistaken for a new one.
pub type WorkerId = u32;
