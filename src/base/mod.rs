//! Leaf helpers with no dependency on any other radixgate module, so every layer (tree, route,
//! proxy) can share one implementation instead of growing its own copy.

pub mod text;
