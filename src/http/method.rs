//! Request methods as a closed set, so routing matches on names the compiler checks instead of
//! byte strings. Unknown tokens stay `Other`: the proxy forwards the original bytes anyway.

/// An HTTP request method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `GET`.
    Get,
    /// `HEAD` (its response has no body, whatever its headers say).
    Head,
    /// `POST`.
    Post,
    /// `PUT`.
    Put,
    /// `DELETE`.
    Delete,
    /// `PATCH`.
    Patch,
    /// `OPTIONS`.
    Options,
    /// Any other token (methods are case-sensitive: `get` is not `GET`).
    Other,
}

impl Method {
    /// The method named by a request line's token.
    pub fn parse(token: &[u8]) -> Method {
        match token {
            b"GET" => Method::Get,
            b"HEAD" => Method::Head,
            b"POST" => Method::Post,
            b"PUT" => Method::Put,
            b"DELETE" => Method::Delete,
            b"PATCH" => Method::Patch,
            b"OPTIONS" => Method::Options,
            _ => Method::Other,
        }
    }

    /// The token on the wire (`Other` has none of its own).
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
            Method::Patch => "PATCH",
            Method::Options => "OPTIONS",
            Method::Other => "OTHER",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_are_case_sensitive() {
        for m in [
            Method::Get,
            Method::Head,
            Method::Post,
            Method::Put,
            Method::Delete,
            Method::Patch,
            Method::Options,
        ] {
            assert_eq!(Method::parse(m.as_str().as_bytes()), m);
        }
        assert_eq!(Method::parse(b"get"), Method::Other);
        assert_eq!(Method::parse(b"BREW"), Method::Other);
    }
}
