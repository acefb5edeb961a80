//! Bearer-key checks. Inference endpoints need `--api-key`; worker management and cache control
//! need `--admin-api-key`, or `--api-key` when no admin key is set (the reference's fallback).
//! Health, readiness, models and server info stay open: orchestrators probe them.

use crate::http::RequestHead;

/// Which key a request must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Inference and the proxied informational calls.
    Inference,
    /// Worker management and cache control.
    Admin,
}

/// The configured keys.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    api_key: Option<String>,
    admin_api_key: Option<String>,
}

impl Auth {
    /// Keys from `--api-key` and `--admin-api-key`.
    pub fn new(api_key: Option<String>, admin_api_key: Option<String>) -> Auth {
        Auth {
            api_key,
            admin_api_key,
        }
    }

    /// Check `Authorization: Bearer <key>` for `scope`, in constant time. `Err` carries the
    /// message the client gets with its 401.
    pub fn authorize(&self, head: &RequestHead, scope: Scope) -> Result<(), &'static str> {
        let expected = match scope {
            Scope::Admin => self.admin_api_key.as_deref().or(self.api_key.as_deref()),
            Scope::Inference => self.api_key.as_deref(),
        };
        let Some(expected) = expected else {
            return Ok(());
        };
        let given = head.header("authorization").and_then(|v| {
            v.strip_prefix(b"Bearer ")
                .or_else(|| v.strip_prefix(b"bearer "))
        });
        match given {
            Some(g) if constant_time_eq(g, expected.as_bytes()) => Ok(()),
            Some(_) => Err("invalid API key"),
            None => Err("missing `Authorization: Bearer <key>` header"),
        }
    }
}

/// Compare two secrets in time independent of where they differ (the length is not secret).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{parse_request_head, HeadLimits};
    use bytes::BytesMut;

    fn head(auth: Option<&str>) -> RequestHead {
        let mut raw = String::from("GET /workers HTTP/1.1\r\nhost: x\r\n");
        if let Some(a) = auth {
            raw.push_str(&format!("authorization: {a}\r\n"));
        }
        raw.push_str("\r\n");
        let mut buf = BytesMut::from(raw.as_bytes());
        parse_request_head(&mut buf, &HeadLimits::default())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn admin_falls_back_to_the_api_key() {
        let a = Auth::new(Some("k".into()), None);
        assert!(a.authorize(&head(Some("Bearer k")), Scope::Admin).is_ok());
        assert!(a.authorize(&head(Some("Bearer x")), Scope::Admin).is_err());
        assert!(a.authorize(&head(None), Scope::Admin).is_err());
    }

    #[test]
    fn the_admin_key_does_not_open_inference() {
        let a = Auth::new(Some("k".into()), Some("adm".into()));
        assert!(a.authorize(&head(Some("Bearer adm")), Scope::Admin).is_ok());
        assert!(a.authorize(&head(Some("Bearer k")), Scope::Admin).is_err());
        assert!(a
            .authorize(&head(Some("Bearer adm")), Scope::Inference)
            .is_err());
        assert!(a
            .authorize(&head(Some("bearer k")), Scope::Inference)
            .is_ok());
    }

    #[test]
    fn no_keys_means_open() {
        let a = Auth::default();
        assert!(a.authorize(&head(None), Scope::Admin).is_ok());
        assert!(a.authorize(&head(None), Scope::Inference).is_ok());
    }

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
