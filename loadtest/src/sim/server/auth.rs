//! `--api-key`: SGLang's API-key middleware as a worker started with only `--api-key` applies
//! it (SGLang 0.5.23, `sglang/srt/utils/auth.py`: `add_api_key_middleware` at line 154 asks
//! `decide_request_auth`, lines 74-151): OPTIONS and paths starting with `/health`, `/ready` or
//! `/metrics` pass without a key (lines 98-106); every other path, known or not, needs
//! `Authorization: Bearer <key>` (scheme case-insensitive, split at the first space, lines
//! 108-117), else 401 `{"error": "Unauthorized"}` (lines 192-204). A gateway in front of such a
//! worker must send the key on its own calls (`/get_server_info`, `/v1/models`,
//! `/flush_cache`, ...), not only on the requests it forwards. A vLLM-shaped worker
//! (`--engine vllm`) applies vLLM's rule instead ([`allowed_vllm`]): only its API prefixes are
//! guarded.

/// The body SGLang's middleware answers a refused request with.
pub(super) const UNAUTHORIZED_BODY: &[u8] = br#"{"error":"Unauthorized"}"#;

/// Whether a request with this method, path and `authorization` value passes a worker whose
/// `--api-key` is `key` (always, without one).
pub(super) fn allowed(
    key: Option<&str>,
    method: &[u8],
    path: &[u8],
    authorization: Option<&[u8]>,
) -> bool {
    let Some(key) = key else {
        return true;
    };
    if method == b"OPTIONS"
        || [&b"/health"[..], b"/ready", b"/metrics"]
            .iter()
            .any(|p| path.starts_with(p))
    {
        return true;
    }
    bearer_matches(key, authorization)
}

/// Path prefixes vLLM's `--api-key` guards (`vllm/entrypoints/serve/middleware/authenticate.py`,
/// `GUARDED_PREFIX`); every other path, `/health`, `/metrics` and `/kv_event_sources` among them,
/// passes without the key.
const VLLM_GUARDED: [&[u8]; 4] = [b"/v1", b"/v2", b"/inference", b"/cohere"];

/// [`allowed`] for a vLLM-shaped worker: OPTIONS and paths outside [`VLLM_GUARDED`] pass; the
/// guarded ones need the key, checked the same way (vLLM also splits at the first space and
/// compares the scheme case-insensitively), refused with the same body.
pub(super) fn allowed_vllm(
    key: Option<&str>,
    method: &[u8],
    path: &[u8],
    authorization: Option<&[u8]>,
) -> bool {
    let Some(key) = key else {
        return true;
    };
    if method == b"OPTIONS" || !VLLM_GUARDED.iter().any(|p| path.starts_with(p)) {
        return true;
    }
    bearer_matches(key, authorization)
}

/// Whether `authorization` is `Bearer <key>` (scheme case-insensitive, split at the first
/// space).
fn bearer_matches(key: &str, authorization: Option<&[u8]>) -> bool {
    let Some(value) = authorization else {
        return false;
    };
    let Some(space) = value.iter().position(|&b| b == b' ') else {
        return false;
    };
    let (scheme, token) = (&value[..space], &value[space + 1..]);
    scheme.eq_ignore_ascii_case(b"bearer") && token == key.as_bytes()
}

#[cfg(test)]
mod tests {
    use super::{allowed, allowed_vllm};

    #[test]
    fn vllm_guards_only_its_api_prefixes() {
        let k = Some("sk");
        for path in [
            "/health",
            "/metrics",
            "/kv_event_sources",
            "/tokenize",
            "/version",
        ] {
            assert!(allowed_vllm(k, b"GET", path.as_bytes(), None), "{path}");
        }
        for path in ["/v1/models", "/v1/completions", "/inference/v1/generate"] {
            assert!(!allowed_vllm(k, b"POST", path.as_bytes(), None), "{path}");
            assert!(!allowed_vllm(
                k,
                b"POST",
                path.as_bytes(),
                Some(b"Bearer x")
            ));
            assert!(allowed_vllm(
                k,
                b"POST",
                path.as_bytes(),
                Some(b"bearer sk")
            ));
            assert!(allowed_vllm(k, b"OPTIONS", path.as_bytes(), None));
        }
    }

    #[test]
    fn only_health_ready_metrics_and_options_pass_without_the_key() {
        let k = Some("sk");
        for path in [
            "/health",
            "/health_generate",
            "/ready",
            "/metrics",
            "/metricsx",
        ] {
            assert!(allowed(k, b"GET", path.as_bytes(), None), "{path}");
        }
        assert!(allowed(k, b"OPTIONS", b"/generate", None));
        for path in [
            "/generate",
            "/v1/models",
            "/flush_cache",
            "/get_server_info",
            "/nope",
        ] {
            assert!(!allowed(k, b"GET", path.as_bytes(), None), "{path}");
            assert!(!allowed(k, b"GET", path.as_bytes(), Some(b"Bearer other")));
            assert!(!allowed(k, b"GET", path.as_bytes(), Some(b"sk")));
            assert!(!allowed(k, b"GET", path.as_bytes(), Some(b"Basic sk")));
            assert!(allowed(k, b"GET", path.as_bytes(), Some(b"Bearer sk")));
            assert!(allowed(k, b"GET", path.as_bytes(), Some(b"bearer sk")));
            assert!(allowed(None, b"GET", path.as_bytes(), None));
        }
    }
}
