//! The mechanics of proxying to a worker, below any knowledge of the gateway's shared state:
//! forwarding one request (`forward`) and relaying its response as it arrives (`relay`), per-core
//! upstream connection pools (`pool`), the byte-level I/O helpers (`io`), learning a reply's text
//! (`capture`), draining an answer nobody reads (`discard`), request ids (`request_id`), the retry
//! schedule (`retry`), and one blocking `GET` for helper threads (`blocking`). Callers pass in
//! the pool, timeouts and deadlines; nothing here imports `gateway` or `serve`.

pub mod blocking;
pub mod capture;
pub mod discard;
pub mod forward;
pub mod io;
pub mod pool;
pub mod relay;
pub mod request_id;
pub mod retry;
