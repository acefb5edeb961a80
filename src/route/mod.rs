//! Choosing a worker for a request, pure: what to route on (`extract`), the vocabulary every
//! policy shares (`types`), the front door (`policy`) and the policies (`cache_aware`, `manual`,
//! `hashing`, `bucket`), the inserts the tree writer has not published yet (`recent`), the
//! prompts routed with KV events that the servers have not confirmed yet (`pending`), and the
//! body splices of PD's bootstrap fields and DP ranks (`bootstrap`).
pub mod bootstrap;
pub mod bucket;
pub mod cache_aware;
pub mod extract;
pub mod hashing;
pub mod manual;
pub mod pending;
pub mod policy;
pub mod recent;
pub mod types;
