//! Exact routing state from the servers' own KV-cache events (issue 10): each worker publishes
//! which token blocks it stored and evicted; every gateway copy subscribes to every worker, so all
//! copies hold the same view without talking to each other. `index` is the token-block index
//! those events feed (single writer, lock-free snapshot readers on every core).

pub mod index;
