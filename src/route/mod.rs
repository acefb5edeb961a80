//! Choosing a worker for a request: what to route on (`extract`) and the policies.
pub mod bucket;
pub mod cache_aware;
pub mod extract;
pub mod hashing;
pub mod manual;
pub mod policy;
pub mod recent;
pub mod types;
