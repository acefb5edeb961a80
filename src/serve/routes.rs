//! Which handler answers a method and path. Pure: tested alone.

use super::admin::{self, Endpoint};
use super::exchange::Forwarding;
use crate::http::Method;
use crate::route::extract::Api;

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
        b"/v1/chat/completions" => routed(Api::Chat),
        b"/v1/completions" => routed(Api::Completions),
        b"/v1/embeddings" => routed(Api::Embeddings),
        b"/v1/rerank" | b"/rerank" => routed(Api::Rerank),
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
        assert_eq!(route(Method::Get, b"/nope"), Route::NotFound);
        assert!(matches!(route(Method::Get, b"/health"), Route::Local(_)));
    }
}
