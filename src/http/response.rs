//! Responses the gateway writes itself (errors, local endpoints, 100 Continue), rendered into a
//! single buffer so each is one write.

use bytes::Bytes;

/// `HTTP/1.1 100 Continue\r\n\r\n`.
pub const CONTINUE_100: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Canonical reason phrase for a status code ("Unknown" otherwise).
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        425 => "Too Early",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Render a complete response: status line, `content-type`, `content-length`, each extra header
/// (name, value), `connection: close` when `close` is set, then the body.
///
/// Statuses that cannot carry a body (1xx, 204, 304) get neither body nor body headers. A
/// status outside 100..=999 is rendered as 500 rather than as an invalid status line. CR, LF
/// and NUL in header names or values are replaced by spaces, so a value echoed from elsewhere
/// can never split the response.
pub fn render(
    status: u16,
    content_type: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
    close: bool,
) -> Bytes {
    let status = if (100..=999).contains(&status) {
        status
    } else {
        500
    };
    let bodyless = (100..200).contains(&status) || status == 204 || status == 304;
    let extras: usize = extra_headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 4)
        .sum();
    let mut out = Vec::with_capacity(96 + content_type.len() + extras + body.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    push_decimal(&mut out, u64::from(status));
    out.push(b' ');
    out.extend_from_slice(reason(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    if !bodyless {
        push_header(&mut out, "content-type", content_type);
        out.extend_from_slice(b"content-length: ");
        push_decimal(&mut out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in extra_headers {
        push_header(&mut out, name, value);
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !bodyless {
        out.extend_from_slice(body);
    }
    Bytes::from(out)
}

/// An OpenAI-style error body: `{"error":{"message":..,"type":..,"code":status}}` (message JSON-escaped).
pub fn error_body(status: u16, error_type: &str, message: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + message.len() + error_type.len());
    out.extend_from_slice(b"{\"error\":{\"message\":");
    push_json_string(&mut out, message);
    out.extend_from_slice(b",\"type\":");
    push_json_string(&mut out, error_type);
    out.extend_from_slice(b",\"code\":");
    push_decimal(&mut out, u64::from(status));
    out.extend_from_slice(b"}}");
    out
}

/// A full error response with the OpenAI-style body.
pub fn error_response(
    status: u16,
    error_type: &str,
    message: &str,
    extra_headers: &[(&str, &str)],
    close: bool,
) -> Bytes {
    let body = error_body(status, error_type, message);
    render(status, "application/json", extra_headers, &body, close)
}

/// Append `s` as a JSON string literal (RFC 8259 §7): quotes and backslashes escaped, control
/// characters as `\u00XX` (with the short forms for the common ones); everything else, including
/// non-ASCII UTF-8, copied through in runs.
pub fn push_json_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run_start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run_start..i]);
        run_start = i + 1;
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(short);
        }
    }
    out.extend_from_slice(&bytes[run_start..]);
    out.push(b'"');
}

/// Append a header line, neutralising bytes that would end the line early.
fn push_header(out: &mut Vec<u8>, name: &str, value: &str) {
    push_sanitized(out, name.as_bytes());
    out.extend_from_slice(b": ");
    push_sanitized(out, value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn push_sanitized(out: &mut Vec<u8>, s: &[u8]) {
    out.extend(s.iter().map(|&b| match b {
        b'\r' | b'\n' | 0 => b' ',
        _ => b,
    }));
}

/// Append `n` in decimal without going through `fmt` (no `Result` to handle).
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests;
