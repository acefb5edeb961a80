//! Which namespace discovery watches: its trust boundary. Anyone who can label a pod in a
//! watched namespace can make it a worker, and a worker receives prompts, so the default is the
//! narrowest one that works: the gateway's own namespace in a pod, the kubeconfig context's
//! namespace outside one. Every namespace only when `--service-discovery-all-namespaces` asks.
//! The decision is pure ([`choose`]); the inputs are read by [`Inputs::read`].

use std::path::Path;

/// Where a pod's service account namespace is mounted.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
/// The environment variable a Deployment sets from the downward API (`metadata.namespace`).
pub const POD_NAMESPACE_ENV: &str = "POD_NAMESPACE";

/// The namespaces watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// One namespace, and why that one.
    One(String, Why),
    /// Every namespace (`--service-discovery-all-namespaces`).
    All,
}

/// Where the namespace came from (for the start-up log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// `--service-discovery-namespace`.
    Flag,
    /// `$POD_NAMESPACE`: the gateway's own pod.
    PodEnv,
    /// The service account's namespace file: the gateway's own pod.
    ServiceAccount,
    /// The client's default: the kubeconfig context's namespace, else `default`.
    Client,
}

impl Why {
    /// How the log line names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Flag => "--service-discovery-namespace",
            Why::PodEnv => "the gateway's own pod ($POD_NAMESPACE)",
            Why::ServiceAccount => "the gateway's own pod (service account)",
            Why::Client => "the kubeconfig context, else `default`",
        }
    }
}

/// What the decision reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    /// `--service-discovery-namespace`.
    pub flag: Option<String>,
    /// `--service-discovery-all-namespaces`.
    pub all: bool,
    /// `$POD_NAMESPACE`.
    pub pod_env: Option<String>,
    /// The service account namespace file's contents, when it exists.
    pub service_account: Option<String>,
}

impl Inputs {
    /// Read the environment and the namespace file at `sa_path` ([`SERVICE_ACCOUNT_NAMESPACE`]
    /// outside tests).
    pub fn read(flag: Option<String>, all: bool, sa_path: &Path) -> Inputs {
        Inputs {
            flag,
            all,
            pod_env: std::env::var(POD_NAMESPACE_ENV).ok(),
            service_account: std::fs::read_to_string(sa_path).ok(),
        }
    }
}

/// The namespaces to watch: the flag; else every one when asked; else the gateway's own pod's
/// (`$POD_NAMESPACE`, then the service account file); else `client_default`, the client
/// config's namespace (the kubeconfig context's, else `default`). A value that is not a
/// namespace name (RFC 1123 label) is skipped.
pub fn choose(inputs: &Inputs, client_default: &str) -> Scope {
    if let Some(ns) = &inputs.flag {
        return Scope::One(ns.clone(), Why::Flag);
    }
    if inputs.all {
        return Scope::All;
    }
    let own = [
        (inputs.pod_env.as_deref(), Why::PodEnv),
        (inputs.service_account.as_deref(), Why::ServiceAccount),
    ];
    for (value, why) in own {
        if let Some(ns) = value.map(str::trim).filter(|v| is_namespace(v)) {
            return Scope::One(ns.to_string(), why);
        }
    }
    let ns = Some(client_default.trim())
        .filter(|v| is_namespace(v))
        .unwrap_or("default");
    Scope::One(ns.to_string(), Why::Client)
}

/// An RFC 1123 label: 1 to 63 lowercase letters, digits and `-`, starting and ending with a
/// letter or digit (what Kubernetes accepts as a namespace name).
fn is_namespace(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    (1..=63).contains(&b.len())
        && b.iter().all(|c| inner(c) || *c == b'-')
        && b.first().is_some_and(inner)
        && b.last().is_some_and(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(ns: &str, why: Why) -> Scope {
        Scope::One(ns.into(), why)
    }

    #[test]
    fn the_flag_then_all_namespaces_then_the_own_pod_then_the_client() {
        let mut i = Inputs {
            flag: Some("ml".into()),
            all: false,
            pod_env: Some("env-ns".into()),
            service_account: Some("sa-ns\n".into()),
        };
        assert_eq!(choose(&i, "kc"), one("ml", Why::Flag));
        i.flag = None;
        assert_eq!(choose(&i, "kc"), one("env-ns", Why::PodEnv));
        i.pod_env = None;
        assert_eq!(choose(&i, "kc"), one("sa-ns", Why::ServiceAccount));
        i.service_account = None;
        assert_eq!(choose(&i, "kc"), one("kc", Why::Client));
        assert_eq!(choose(&i, ""), one("default", Why::Client));
        i.all = true;
        assert_eq!(choose(&i, "kc"), Scope::All, "only when asked");
        i.pod_env = Some("env-ns".into());
        assert_eq!(choose(&i, "kc"), Scope::All);
    }

    #[test]
    fn never_every_namespace_by_default() {
        for i in [
            Inputs::default(),
            Inputs {
                pod_env: Some(String::new()),
                service_account: Some(" \n".into()),
                ..Inputs::default()
            },
        ] {
            assert_eq!(choose(&i, "default"), one("default", Why::Client));
        }
    }

    #[test]
    fn values_that_are_not_namespace_names_are_skipped() {
        for bad in ["../x", "A", "a/b", "-a", "a-", &"a".repeat(64), "a b"] {
            assert!(!is_namespace(bad), "{bad}");
            let i = Inputs {
                pod_env: Some(bad.into()),
                service_account: Some("sa".into()),
                ..Inputs::default()
            };
            assert_eq!(choose(&i, "kc"), one("sa", Why::ServiceAccount), "{bad}");
        }
        assert!(is_namespace("a") && is_namespace("team-7"));
    }

    #[test]
    fn inputs_are_read_from_the_namespace_file() {
        let dir = std::env::temp_dir().join(format!("radixgate-scope-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("namespace");
        std::fs::write(&file, "gw-ns").unwrap();
        let i = Inputs::read(None, false, &file);
        assert_eq!(i.service_account.as_deref(), Some("gw-ns"));
        let missing = Inputs::read(None, false, &dir.join("absent"));
        assert_eq!(missing.service_account, None);
        std::fs::remove_dir_all(&dir).unwrap();
        // Outside a pod (no env, no file) the client's namespace is used.
        let outside = Inputs {
            pod_env: None,
            ..missing
        };
        assert_eq!(choose(&outside, "kc"), one("kc", Why::Client));
    }
}
