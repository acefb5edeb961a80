//! Responses the gateway writes itself (errors, local endpoints, 100 Continue), rendered into a
//! single buffer so each is one write.

use bytes::Bytes;

/// `HTTP/1.1 100 Continue\r\n\r\n`.
pub const CONTINUE_100: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Canonical reason phrase for a status code ("Unknown" otherwise).
pub fn reason(status: u16) -> &'static str {
    let _ = status;
    todo!()
}

/// Render a complete response: status line, `content-type`, `content-length`, each extra header
/// (name, value), `connection: close` when `close` is set, then the body.
pub fn render(status: u16, content_type: &str, extra_headers: &[(&str, &str)], body: &[u8], close: bool) -> Bytes {
    let _ = (status, content_type, extra_headers, body, close);
    todo!()
}

/// An OpenAI-style error body: `{"error":{"message":..,"type":..,"code":status}}` (message JSON-escaped).
pub fn error_body(status: u16, error_type: &str, message: &str) -> Vec<u8> {
    let _ = (status, error_type, message);
    todo!()
}

/// A full error response with the OpenAI-style body.
pub fn error_response(status: u16, error_type: &str, message: &str, extra_headers: &[(&str, &str)], close: bool) -> Bytes {
    let body = error_body(status, error_type, message);
    render(status, "application/json", extra_headers, &body, close)
}
