//! The set of upstream workers: who they are (`registry`), how busy they are (`load`).
pub mod breaker;
pub mod health;
pub mod load;
pub mod registry;
