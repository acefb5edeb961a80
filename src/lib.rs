//! radixgate: a cache-aware LLM gateway. See `README.md` and `design.md` for the architecture;
//! the module tree follows one request from socket to worker and back.

pub mod http;
pub mod route;
pub mod tree;
pub mod workers;
