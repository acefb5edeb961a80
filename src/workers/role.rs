//! What a worker does in a prefill/decode disaggregated fleet (`--pd-disaggregation`): a
//! regular worker serves whole requests; a prefill worker computes the prompt's KV cache and
//! hands it over through its bootstrap port; a decode worker generates from the handed-over
//! cache. The role decides which side's policy may pick the worker.

/// A worker's part in serving a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Serves whole requests (the only role outside PD mode).
    #[default]
    Regular,
    /// Computes the prompt; `bootstrap_port` is the KV hand-over port sent to the decode side
    /// (`None`: the decode server uses its own `--disaggregation-bootstrap-port`).
    Prefill {
        /// The worker's `--disaggregation-bootstrap-port`, when configured.
        bootstrap_port: Option<u16>,
    },
    /// Generates from a prompt cache handed over by a prefill worker.
    Decode,
}

impl Role {
    /// The name the management API and the reference use (`worker_type`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Regular => "regular",
            Role::Prefill { .. } => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role named `worker_type` (`regular`, `prefill`, `decode`) with `bootstrap_port`
    /// (meaningful for prefill only; refused elsewhere so a typo does not pass silently).
    pub fn parse(worker_type: &str, bootstrap_port: Option<u16>) -> Result<Role, RoleError> {
        match (worker_type, bootstrap_port) {
            ("prefill", port) => Ok(Role::Prefill {
                bootstrap_port: port,
            }),
            ("regular", None) => Ok(Role::Regular),
            ("decode", None) => Ok(Role::Decode),
            ("regular" | "decode", Some(_)) => Err(RoleError::PortNotPrefill),
            (other, _) => Err(RoleError::UnknownType(other.to_string())),
        }
    }

    /// Whether this is a prefill worker.
    pub fn is_prefill(self) -> bool {
        matches!(self, Role::Prefill { .. })
    }
}

/// Why [`Role::parse`] refused a role: the management API answers 400 with its text, so an
/// operator's typo is named rather than registered as some other role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoleError {
    /// A bootstrap port given for a regular or decode worker.
    PortNotPrefill,
    /// A `worker_type` that is none of regular, prefill, decode.
    UnknownType(String),
}

impl std::fmt::Display for RoleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoleError::PortNotPrefill => {
                f.write_str("`bootstrap_port` is meaningful for prefill workers only")
            }
            RoleError::UnknownType(other) => write!(
                f,
                "unknown worker_type `{other}` (expected regular, prefill or decode)"
            ),
        }
    }
}

impl std::error::Error for RoleError {}

/// Which workers one router picks from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Every worker (outside PD mode).
    Any,
    /// Prefill workers only.
    Prefill,
    /// Decode workers only.
    Decode,
}

impl Side {
    /// The side's name in messages (`any` outside PD mode).
    pub fn name(self) -> &'static str {
        match self {
            Side::Any => "any",
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }

    /// Whether a worker of `role` is picked from this side.
    pub fn takes(self, role: Role) -> bool {
        match self {
            Side::Any => true,
            Side::Prefill => role.is_prefill(),
            Side::Decode => role == Role::Decode,
        }
    }
}

/// Parse a `--prefill` value list: each `URL` optionally followed by its bootstrap port or
/// `none` (the reference's `--prefill URL [BOOTSTRAP_PORT|none]`, repeatable; every occurrence's
/// values arrive here in order, so `--prefill A 8998 --prefill B` is `[A, 8998, B]`). A value
/// that starts with `http` begins a new worker; anything else is the previous worker's port.
pub fn parse_prefill_values(values: &[String]) -> Result<Vec<(String, Option<u16>)>, String> {
    let mut out: Vec<(String, Option<u16>, bool)> = Vec::with_capacity(values.len());
    for v in values {
        if v.starts_with("http") {
            out.push((v.trim_end_matches('/').to_string(), None, false));
            continue;
        }
        let Some(last) = out.last_mut() else {
            return Err(format!("--prefill: `{v}` must follow a worker URL"));
        };
        if last.2 {
            return Err(format!(
                "--prefill {}: more than one bootstrap port (`{v}`)",
                last.0
            ));
        }
        last.2 = true;
        last.1 = match v.as_str() {
            "none" | "None" | "null" => None,
            p => match p.parse::<u16>() {
                Ok(n) if n > 0 => Some(n),
                _ => {
                    return Err(format!(
                        "--prefill {}: bootstrap port `{p}` is not a port number or `none`",
                        last.0
                    ))
                }
            },
        };
    }
    Ok(out.into_iter().map(|(u, p, _)| (u, p)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn prefill_values_pair_urls_with_optional_ports() {
        let got = parse_prefill_values(&v(&[
            "http://a:1",
            "8998",
            "http://b:2/",
            "http://c:3",
            "none",
        ]))
        .unwrap();
        assert_eq!(
            got,
            vec![
                ("http://a:1".to_string(), Some(8998)),
                ("http://b:2".to_string(), None),
                ("http://c:3".to_string(), None),
            ]
        );
        assert!(parse_prefill_values(&v(&["8998"])).is_err());
        assert!(parse_prefill_values(&v(&["http://a:1", "1", "2"])).is_err());
        assert!(parse_prefill_values(&v(&["http://a:1", "x"])).is_err());
        assert!(parse_prefill_values(&v(&["http://a:1", "0"])).is_err());
        assert!(parse_prefill_values(&v(&["http://a:1", "70000"])).is_err());
    }

    #[test]
    fn worker_types_parse_as_the_reference_names_them() {
        assert_eq!(
            Role::parse("prefill", Some(9)),
            Ok(Role::Prefill {
                bootstrap_port: Some(9)
            })
        );
        assert_eq!(Role::parse("decode", None), Ok(Role::Decode));
        assert_eq!(Role::parse("regular", None), Ok(Role::Regular));
        assert!(Role::parse("decode", Some(1)).is_err());
        assert!(Role::parse("gpu", None).is_err());
        assert_eq!(Role::Decode.as_str(), "decode");
    }
}
