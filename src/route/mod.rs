//! Choosing a worker for a request, pure: what to route on (`extract`), the vocabulary every
//! policy shares and the list of policies (`types`), the front door and one file per policy
//! (`policy`), the hash ring two of them place keys on (`ring`), the inserts the tree writer has
//! not published yet (`recent`), the prompts routed with KV events that the servers have not
//! confirmed yet (`pending`), and the body splices of PD's bootstrap fields and DP ranks
//! (`bootstrap`).
pub mod bootstrap;
pub mod extract;
pub mod pending;
pub mod policy;
pub mod recent;
pub mod ring;
pub mod types;
