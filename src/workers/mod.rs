//! The set of upstream workers: who they are (`registry`), what they do in a prefill/decode
//! fleet (`role`), how busy they are (`load`), and whether their circuit admits requests
//! (`breaker`). Active health checks, which need the
//! network, run above this layer (`gateway::threads::health`).
pub mod breaker;
pub mod load;
pub mod registry;
pub mod role;
