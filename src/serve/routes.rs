//! Which handler answers a method and path, which key it needs and how large a body it may
//! carry: all decided on the head, before any body byte is read. Pure: tested alone.

use super::admin::{self, Endpoint};
use super::exchange::Forwarding;
use crate::gateway::Scope;
use crate::http::Method;
use crate::route::extract::Api;

/// Largest body a request that is not inference may carry (worker management takes one URL,
/// everything else nothing), so a client cannot make the gateway buffer `--max-payload-size`
/// bytes for an endpoint that never reads them.
pub const LOCAL_BODY_LIMIT: u64 = 64 * 1024;

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Proxied to a worker: routed by the policy, or passed through to any selectable worker.
    Proxy(Forwarding),
    /// Answered by the gateway itself.
    Local(Endpoint),
    /// Known path, wrong method.
    MethodNotAllowed,
    /// Unknown path.
    NotFound,
}

impl Route {
    /// The key the request must carry (`None`: public, or refused anyway). Checked on the head,
    /// so an unauthorised upload is refused before its body is read.
    pub fn scope(self) -> Option<Scope> {
        match self {
            Route::Proxy(Forwarding::Routed(_)) => Some(Scope::Inference),
            // Cancels inference: whoever may send a request may abort their own, and the admin
            // may abort any (aborting every request, or one the gateway does not know as the
            // caller's, needs control: checked against the body).
            Route::Local(Endpoint::AbortRequest) => Some(Scope::Cancel),
            Route::Local(Endpoint::KvSnapshot) => Some(Scope::Secret),
            Route::Local(ep) if ep.is_control() => Some(Scope::Control),
            Route::Local(ep) if ep.is_admin() => Some(Scope::Admin),
            _ => None,
        }
    }

    /// Largest body this route accepts: `max_payload` (`--max-payload-size`) for inference,
    /// [`LOCAL_BODY_LIMIT`] (or less) for everything else.
    pub fn body_limit(self, max_payload: u64) -> u64 {
        match self {
            Route::Proxy(Forwarding::Routed(_)) => max_payload,
            _ => max_payload.min(LOCAL_BODY_LIMIT),
        }
    }
}

/// Map method and path to a route.
pub fn route(method: Method, path: &[u8]) -> Route {
    let routed = |api| {
        if method == Method::Post {
            Route::Proxy(Forwarding::Routed(api))
        } else {
            Route::MethodNotAllowed
        }
    };
    match path {
        b"/generate" => routed(Api::Generate),
        b"/inference/v1/generate" => routed(Api::TokenGenerate),
        b"/v1/chat/completions" => routed(Api::Chat),
        b"/v1/completions" => routed(Api::Completions),
        b"/v1/embeddings" => routed(Api::Embeddings),
        b"/v1/rerank" | b"/rerank" => routed(Api::Rerank),
        b"/v1/responses" => routed(Api::Responses),
        b"/v1/messages" => routed(Api::Messages),
        b"/get_model_info" | b"/model_info" | b"/health_generate" => {
            if method == Method::Get {
                Route::Proxy(Forwarding::PassThrough)
            } else {
                Route::MethodNotAllowed
            }
        }
        _ => match admin::endpoint(method, path) {
            Some(Ok(e)) => Route::Local(e),
            Some(Err(())) => Route::MethodNotAllowed,
            None => Route::NotFound,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route(Method::Post, b"/v1/chat/completions"),
            Route::Proxy(Forwarding::Routed(Api::Chat))
        );
        assert_eq!(
            route(Method::Get, b"/v1/chat/completions"),
            Route::MethodNotAllowed
        );
        assert_eq!(
            route(Method::Post, b"/rerank"),
            Route::Proxy(Forwarding::Routed(Api::Rerank))
        );
        assert_eq!(
            route(Method::Get, b"/get_model_info"),
            Route::Proxy(Forwarding::PassThrough)
        );
        assert_eq!(
            route(Method::Post, b"/health_generate"),
            Route::MethodNotAllowed
        );
        assert_eq!(
            route(Method::Post, b"/v1/responses"),
            Route::Proxy(Forwarding::Routed(Api::Responses))
        );
        assert_eq!(
            route(Method::Post, b"/v1/messages"),
            Route::Proxy(Forwarding::Routed(Api::Messages))
        );
        assert_eq!(route(Method::Get, b"/v1/messages"), Route::MethodNotAllowed);
        assert_eq!(route(Method::Get, b"/nope"), Route::NotFound);
        assert!(matches!(route(Method::Get, b"/health"), Route::Local(_)));
        // vLLM's token-in/token-out route is routed; its neighbours stay unknown.
        assert_eq!(
            route(Method::Post, b"/inference/v1/generate"),
            Route::Proxy(Forwarding::Routed(Api::TokenGenerate))
        );
        assert_eq!(
            route(Method::Get, b"/inference/v1/generate"),
            Route::MethodNotAllowed
        );
        assert_eq!(
            route(Method::Post, b"/inference/v1/generatex"),
            Route::NotFound
        );
        assert_eq!(route(Method::Post, b"/inference/v1"), Route::NotFound);
    }

    #[test]
    fn keys_and_body_limits_are_known_from_the_head() {
        let chat = route(Method::Post, b"/v1/chat/completions");
        assert_eq!(chat.scope(), Some(Scope::Inference));
        assert_eq!(chat.body_limit(1 << 29), 1 << 29);
        let add = route(Method::Post, b"/workers");
        assert_eq!(add.scope(), Some(Scope::Control));
        assert_eq!(
            route(Method::Post, b"/flush_cache").scope(),
            Some(Scope::Control)
        );
        assert_eq!(route(Method::Get, b"/workers").scope(), Some(Scope::Admin));
        assert_eq!(
            route(Method::Get, b"/kv_index/snapshot").scope(),
            Some(Scope::Secret)
        );
        assert_eq!(add.body_limit(1 << 29), LOCAL_BODY_LIMIT);
        assert_eq!(add.body_limit(100), 100);
        let health = route(Method::Get, b"/health");
        assert_eq!(health.scope(), None);
        let info = route(Method::Get, b"/get_model_info");
        assert_eq!(info.scope(), None);
        assert_eq!(info.body_limit(1 << 29), LOCAL_BODY_LIMIT);
        assert_eq!(route(Method::Get, b"/nope").scope(), None);
        let abort = route(Method::Post, b"/abort_request");
        assert_eq!(abort, Route::Local(Endpoint::AbortRequest));
        assert_eq!(abort.scope(), Some(Scope::Cancel));
        assert_eq!(abort.body_limit(1 << 29), LOCAL_BODY_LIMIT);
    }
}
