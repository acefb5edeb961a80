//! Request ids: taken from the first configured header the client sent, else generated with the
//! reference's prefixes (`chatcmpl-`, `cmpl-`, `gnt-`, `resp-`, `req-`) and 24 random alphanumerics.

use crate::base::rng::Rng;
use crate::http::RequestHead;

const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// The id for this request and whether it came from the client.
pub fn request_id(head: &RequestHead, headers: &[String], path: &[u8], rng: &mut Rng) -> String {
    for name in headers {
        if let Some(v) = head.header(name) {
            if !v.is_empty() && v.len() <= 256 && v.iter().all(|b| b.is_ascii_graphic()) {
                // Checked above: printable ASCII.
                return String::from_utf8_lossy(v).into_owned();
            }
        }
    }
    let prefix = match path {
        b"/v1/chat/completions" => "chatcmpl-",
        b"/v1/completions" => "cmpl-",
        b"/generate" => "gnt-",
        b"/v1/responses" => "resp-",
        _ => "req-",
    };
    let mut id = String::with_capacity(prefix.len() + 24);
    id.push_str(prefix);
    for _ in 0..24 {
        id.push(ALPHABET[rng.below(ALPHABET.len())] as char);
    }
    id
}
