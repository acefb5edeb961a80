//! Request ids: taken from the first configured header the client sent, else generated with the
//! reference's prefixes (`chatcmpl-`, `cmpl-`, `gnt-`, `resp-`, `req-`) and 24 alphanumerics
//! from the kernel's CSPRNG (~143 bits: an id the gateway made up cannot be guessed).

use crate::base::entropy::Entropy;
use crate::http::RequestHead;

const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// The id for this request: the client's, else a new one.
pub fn request_id(
    head: &RequestHead,
    headers: &[String],
    path: &[u8],
    entropy: &mut Entropy,
) -> String {
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
        id.push(entropy.pick(ALPHABET) as char);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{parse_request_head, HeadLimits};

    fn head(extra: &str) -> RequestHead {
        let raw = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: h\r\n{extra}\r\n");
        let mut buf = bytes::BytesMut::from(raw.as_bytes());
        parse_request_head(&mut buf, &HeadLimits::default())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn a_client_id_is_kept_and_a_made_up_one_cannot_be_guessed() {
        let headers = vec!["x-request-id".to_string()];
        let mut e = Entropy::default();
        let path = b"/v1/chat/completions";
        assert_eq!(
            request_id(&head("x-request-id: abc-1\r\n"), &headers, path, &mut e),
            "abc-1"
        );
        // Not printable: ignored, one is made up.
        let made = request_id(&head("x-request-id: a b\r\n"), &headers, path, &mut e);
        assert!(
            made.starts_with("chatcmpl-") && made.len() == 9 + 24,
            "{made}"
        );
        assert!(made[9..].bytes().all(|b| b.is_ascii_alphanumeric()));
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| request_id(&head(""), &headers, path, &mut e))
            .collect();
        assert_eq!(ids.len(), 1000);
    }
}
