//! Who may call what. Inference endpoints need `--api-key`; reads that name workers need
//! `--admin-api-key`, or `--api-key` when no admin key is set (the reference's fallback). Calls
//! that change where traffic goes or cancel other clients' work (adding and removing workers,
//! flushing caches, aborting every request) need the admin key itself; without one configured
//! they are refused, unless `--keyless-local-admin` lets clients on the gateway's own host do
//! them, and then only requests that did not come through a proxy (no `Forwarded`,
//! `X-Forwarded-For` or `X-Real-IP` header: a reverse proxy or sidecar on the same host would
//! otherwise open them to everyone). The KV index copy tells which prompts are cached: only the
//! admin key opens it. Health, readiness, models and server info stay open: orchestrators probe
//! them. With `--api-key` set, a key of the tenant table (`[tenants.NAME] keys`) is an inference
//! key too: per-key tenants do not force a keyless gateway.

use crate::http::RequestHead;
use std::collections::HashSet;
use std::net::IpAddr;

/// What a request must prove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Inference and the proxied informational calls: the API key, when one is set.
    Inference,
    /// `/abort_request`: the API key (a client aborts its own requests) or the admin key (an
    /// operator aborts any, or all); open when neither is set.
    Cancel,
    /// Reads that name workers: the admin key, else the API key, when one is set.
    Admin,
    /// Changes to the worker set, cache flushes, aborting every request: the admin key; without
    /// one, a client on this host not behind a proxy with `--keyless-local-admin`.
    Control,
    /// The KV index copy: the admin key, always.
    Secret,
}

/// A caller's key does not allow the call, with the status it gets. Named apart from
/// `admission::Refusal` and `admission::flow::Denied` (a request turned away because the
/// gateway or its fleet is full): this one is about who is calling, those about how busy the
/// gateway is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRefused {
    /// 401 (no or wrong key) or 403 (not allowed without the admin key).
    pub status: u16,
    /// What the client is told.
    pub message: &'static str,
}

/// The configured keys and the keyless local mode.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    api_key: Option<String>,
    admin_api_key: Option<String>,
    keyless_local: bool,
    /// The tenant table's keys: accepted wherever the API key is.
    tenant_keys: HashSet<String>,
}

impl Auth {
    /// Keys from `--api-key` and `--admin-api-key`; `keyless_local` from
    /// `--keyless-local-admin`.
    pub fn new(
        api_key: Option<String>,
        admin_api_key: Option<String>,
        keyless_local: bool,
    ) -> Auth {
        Auth {
            api_key,
            admin_api_key,
            keyless_local,
            tenant_keys: HashSet::new(),
        }
    }

    /// Also accept the tenant table's `keys` wherever the API key is accepted (inference and
    /// cancelling one's own requests); never for admin reads or control calls.
    pub fn with_tenant_keys(mut self, keys: impl IntoIterator<Item = String>) -> Auth {
        self.tenant_keys = keys.into_iter().filter(|k| !k.is_empty()).collect();
        self
    }

    /// Whether this gateway checks callers' keys itself (`--api-key`, or tenant keys): then a
    /// caller's key is its own business with the gateway, not the workers'.
    pub fn authenticates_callers(&self) -> bool {
        self.api_key.is_some() || !self.tenant_keys.is_empty()
    }

    /// Whether `given` is one of the tenant table's keys. The set is hashed with a per-process
    /// random key, so how long the lookup takes says nothing an attacker can steer; the final
    /// comparison is constant-time.
    fn is_tenant_key(&self, given: &[u8]) -> bool {
        std::str::from_utf8(given)
            .ok()
            .and_then(|g| self.tenant_keys.get(g))
            .is_some_and(|k| constant_time_eq(given, k.as_bytes()))
    }

    /// Check `Authorization: Bearer <key>` (in constant time) and, for a control call without
    /// an admin key, where the request came from (`peer`, its headers).
    pub fn authorize(
        &self,
        head: &RequestHead,
        scope: Scope,
        peer: Option<IpAddr>,
    ) -> Result<(), KeyRefused> {
        let expected = match scope {
            Scope::Inference => self.api_key.as_deref(),
            Scope::Cancel => match (self.api_key.as_deref(), self.admin_api_key.as_deref()) {
                (None, None) => None,
                (inference, admin) => {
                    let given = bearer(head);
                    let matches = |k: Option<&str>| {
                        k.is_some_and(|k| given.is_some_and(|g| constant_time_eq(g, k.as_bytes())))
                    };
                    // Both compared, whichever matches: no early exit tells which key it was.
                    let (a, b) = (matches(inference), matches(admin));
                    let t = inference.is_some() && given.is_some_and(|g| self.is_tenant_key(g));
                    return match (a | b | t, given) {
                        (true, _) => Ok(()),
                        (false, Some(_)) => Err(KeyRefused {
                            status: 401,
                            message: "invalid API key",
                        }),
                        (false, None) => Err(KeyRefused {
                            status: 401,
                            message: "missing `Authorization: Bearer <key>` header",
                        }),
                    };
                }
            },
            Scope::Admin => self.admin_api_key.as_deref().or(self.api_key.as_deref()),
            Scope::Control | Scope::Secret => match self.admin_api_key.as_deref() {
                Some(k) => Some(k),
                None if scope == Scope::Control && self.keyless_local => {
                    return if is_loopback(peer) && !proxied(head) {
                        Ok(())
                    } else {
                        Err(KeyRefused {
                            status: 403,
                            message: "without --admin-api-key only clients on the gateway's own \
                                      host, not through a proxy, may do this",
                        })
                    };
                }
                None => {
                    return Err(KeyRefused {
                        status: 403,
                        message: if scope == Scope::Secret {
                            "this endpoint needs --admin-api-key on the gateway"
                        } else {
                            "this needs --admin-api-key on the gateway (or \
                             --keyless-local-admin for clients on its own host)"
                        },
                    })
                }
            },
        };
        let Some(expected) = expected else {
            return Ok(());
        };
        let given = bearer(head);
        let refuse = |message| {
            Err(KeyRefused {
                status: 401,
                message,
            })
        };
        let tenant_key_counts = scope == Scope::Inference;
        match given {
            Some(g) if constant_time_eq(g, expected.as_bytes()) => Ok(()),
            Some(g) if tenant_key_counts && self.is_tenant_key(g) => Ok(()),
            Some(_) => refuse("invalid API key"),
            None => refuse("missing `Authorization: Bearer <key>` header"),
        }
    }
}

/// The key of `Authorization: Bearer <key>`.
fn bearer(head: &RequestHead) -> Option<&[u8]> {
    head.header("authorization").and_then(|v| {
        v.strip_prefix(b"Bearer ")
            .or_else(|| v.strip_prefix(b"bearer "))
    })
}

/// Whether `peer` is this host (127.0.0.1, ::1, or ::1's IPv4-mapped form).
pub fn is_loopback(peer: Option<IpAddr>) -> bool {
    match peer {
        Some(IpAddr::V4(a)) => a == std::net::Ipv4Addr::LOCALHOST,
        Some(IpAddr::V6(a)) => {
            a == std::net::Ipv6Addr::LOCALHOST
                || a.to_ipv4_mapped() == Some(std::net::Ipv4Addr::LOCALHOST)
        }
        None => false,
    }
}

/// Whether a request says it came through a proxy (any of the headers proxies add).
pub fn proxied(head: &RequestHead) -> bool {
    ["forwarded", "x-forwarded-for", "x-real-ip"]
        .iter()
        .any(|h| head.header(h).is_some())
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
        head_with(auth, "")
    }

    fn head_with(auth: Option<&str>, extra: &str) -> RequestHead {
        let mut raw = String::from("GET /workers HTTP/1.1\r\nhost: x\r\n");
        if let Some(a) = auth {
            raw.push_str(&format!("authorization: {a}\r\n"));
        }
        raw.push_str(extra);
        raw.push_str("\r\n");
        let mut buf = BytesMut::from(raw.as_bytes());
        parse_request_head(&mut buf, &HeadLimits::default())
            .unwrap()
            .unwrap()
    }

    const LOCAL: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));

    fn status(r: Result<(), KeyRefused>) -> u16 {
        r.map_or_else(|e| e.status, |()| 200)
    }

    #[test]
    fn admin_falls_back_to_the_api_key() {
        let a = Auth::new(Some("k".into()), None, false);
        assert!(a
            .authorize(&head(Some("Bearer k")), Scope::Admin, None)
            .is_ok());
        assert!(a
            .authorize(&head(Some("Bearer x")), Scope::Admin, None)
            .is_err());
        assert!(a.authorize(&head(None), Scope::Admin, None).is_err());
    }

    #[test]
    fn the_admin_key_does_not_open_inference() {
        let a = Auth::new(Some("k".into()), Some("adm".into()), false);
        assert!(a
            .authorize(&head(Some("Bearer adm")), Scope::Admin, None)
            .is_ok());
        assert!(a
            .authorize(&head(Some("Bearer k")), Scope::Admin, None)
            .is_err());
        assert!(a
            .authorize(&head(Some("Bearer adm")), Scope::Inference, None)
            .is_err());
        assert!(a
            .authorize(&head(Some("bearer k")), Scope::Inference, None)
            .is_ok());
    }

    #[test]
    fn either_key_may_cancel() {
        let a = Auth::new(Some("k".into()), Some("adm".into()), false);
        assert_eq!(
            status(a.authorize(&head(Some("Bearer k")), Scope::Cancel, None)),
            200
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer adm")), Scope::Cancel, None)),
            200
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer x")), Scope::Cancel, None)),
            401
        );
        assert_eq!(status(a.authorize(&head(None), Scope::Cancel, None)), 401);
        let only_admin = Auth::new(None, Some("adm".into()), false);
        assert_eq!(
            status(only_admin.authorize(&head(None), Scope::Cancel, None)),
            401
        );
        assert_eq!(
            status(Auth::default().authorize(&head(None), Scope::Cancel, None)),
            200
        );
    }

    #[test]
    fn no_keys_means_open_reads_but_no_control() {
        let a = Auth::default();
        assert!(a.authorize(&head(None), Scope::Admin, None).is_ok());
        assert!(a.authorize(&head(None), Scope::Inference, None).is_ok());
        assert_eq!(status(a.authorize(&head(None), Scope::Control, LOCAL)), 403);
        assert_eq!(status(a.authorize(&head(None), Scope::Secret, LOCAL)), 403);
    }

    #[test]
    fn control_needs_the_admin_key_itself_never_the_api_key() {
        let a = Auth::new(Some("k".into()), None, false);
        assert_eq!(
            status(a.authorize(&head(Some("Bearer k")), Scope::Control, LOCAL)),
            403
        );
        let a = Auth::new(Some("k".into()), Some("adm".into()), true);
        assert_eq!(
            status(a.authorize(&head(Some("Bearer k")), Scope::Control, LOCAL)),
            401
        );
        assert_eq!(
            status(a.authorize(&head(None), Scope::Control, LOCAL)),
            401,
            "a key set wins over the local mode"
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer adm")), Scope::Control, None)),
            200
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer adm")), Scope::Secret, None)),
            200
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer k")), Scope::Secret, None)),
            401
        );
    }

    #[test]
    fn the_keyless_local_mode_is_opt_in_local_and_not_behind_a_proxy() {
        let off = Auth::default();
        assert_eq!(
            status(off.authorize(&head(None), Scope::Control, LOCAL)),
            403
        );
        let on = Auth::new(None, None, true);
        assert_eq!(
            status(on.authorize(&head(None), Scope::Control, LOCAL)),
            200
        );
        let v6 = Some(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST));
        assert_eq!(status(on.authorize(&head(None), Scope::Control, v6)), 200);
        let lan = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2)));
        assert_eq!(status(on.authorize(&head(None), Scope::Control, lan)), 403);
        assert_eq!(status(on.authorize(&head(None), Scope::Control, None)), 403);
        for proxy in [
            "x-forwarded-for: 1.2.3.4\r\n",
            "Forwarded: for=1.2.3.4\r\n",
            "X-Real-IP: 1.2.3.4\r\n",
        ] {
            let h = head_with(None, proxy);
            assert_eq!(
                status(on.authorize(&h, Scope::Control, LOCAL)),
                403,
                "{proxy}"
            );
        }
        assert_eq!(
            status(on.authorize(&head(None), Scope::Secret, LOCAL)),
            403,
            "never the index"
        );
        assert!(is_loopback(Some("::ffff:127.0.0.1".parse().unwrap())));
        assert!(!is_loopback(Some("127.0.0.2".parse().unwrap())));
    }

    #[test]
    fn with_an_api_key_a_tenant_key_is_an_inference_key_and_nothing_more() {
        let a = Auth::new(Some("k".into()), Some("adm".into()), false)
            .with_tenant_keys(["t1".to_string(), "t2".to_string()]);
        assert!(a.authenticates_callers());
        for key in ["Bearer k", "Bearer t1", "Bearer t2"] {
            assert_eq!(
                status(a.authorize(&head(Some(key)), Scope::Inference, None)),
                200,
                "{key}"
            );
            assert_eq!(
                status(a.authorize(&head(Some(key)), Scope::Cancel, None)),
                200,
                "{key}"
            );
        }
        assert_eq!(
            status(a.authorize(&head(Some("Bearer t3")), Scope::Inference, None)),
            401
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer t1")), Scope::Admin, None)),
            401,
            "a tenant key reads no workers"
        );
        assert_eq!(
            status(a.authorize(&head(Some("Bearer t1")), Scope::Control, LOCAL)),
            401
        );
        // Tenant keys alone: inference stays open (the keys name tenants), the gateway still
        // counts as checking keys (they are not passed on to workers).
        let t = Auth::default().with_tenant_keys(["t1".to_string()]);
        assert!(t.authenticates_callers());
        assert!(!Auth::default().authenticates_callers());
        assert_eq!(
            status(t.authorize(&head(None), Scope::Inference, None)),
            200
        );
    }

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
