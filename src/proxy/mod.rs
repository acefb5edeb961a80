//! The proxy: one client connection's keep-alive loop (`conn`), the forwarding of one request to
//! a worker and of its response back (`forward`), per-core upstream connection pools (`pool`),
//! and the byte-level I/O helpers they share (`io`).

pub mod capture;
pub mod conn;
pub mod forward;
pub mod inference;
pub mod io;
pub mod pool;
pub mod request_id;
pub mod retry;
