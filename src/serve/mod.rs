//! Serving clients: the keep-alive loop of one connection (`conn`) and its read buffer's sizing
//! (`buffer`), which handler answers a
//! method and path (`routes`), a proxied request as named phases (`exchange`; its prefill/decode twin, `pd`), the endpoints the
//! gateway answers itself (`admin`), one core's table of open connections (`connections`), and
//! the one error type and writer they share (`error`, `reply`). Built on `gateway` (shared state) and `proxy` (upstream mechanics); nothing below
//! imports it.

pub mod admin;
mod buffer;
pub mod conn;
pub mod connections;
pub mod error;
pub mod exchange;
pub mod pd;
pub mod reply;
pub mod routes;

/// How one request ended, as the connection loop and the metrics need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The status the client got (499: it left before the answer).
    pub status: u16,
    /// The connection may serve another request.
    pub keep_alive: bool,
}
