//! Who a request is for: the tenant table of the TOML config (`[tenants.NAME]`: `keys`,
//! `weight`, `max_priority`, `requests_per_minute`, `tokens_per_minute`), looked up by the
//! request's API key, or by a header a trusted front sets (`--tenant-header`). Every request
//! the table does not name is the default tenant, one share for all of them together, so
//! unknown keys cannot each open a share of their own (and the table stays bounded).

use super::queue::Priority;
use super::TenantId;
use serde::Deserialize;
use std::collections::HashMap;
use std::fmt;

/// The name of the tenant every unnamed request belongs to; `[tenants.default]` sets its
/// weight, maximum priority and limits (it takes no keys).
pub const DEFAULT_TENANT: &str = "default";
/// The default tenant's `max_priority` when `[tenants.default]` sets none: keyless and
/// unknown-key callers may not claim a class above the ordinary one (only a configured tenant,
/// or a default entry that says so, can put requests ahead of others).
pub const DEFAULT_MAX_PRIORITY: Priority = 0;
/// Most tenants a table may hold (ids are 16 bits; the metrics carry one series per tenant).
pub const MAX_TENANTS: usize = 1024;

/// One `[tenants.NAME]` entry as written in the config file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// API keys (`Authorization: Bearer KEY` or `x-api-key: KEY`) that are this tenant.
    #[serde(default)]
    pub keys: Vec<String>,
    /// Its share of the fleet under saturation, relative to the others' (default 1).
    #[serde(default = "one")]
    pub weight: f64,
    /// The highest priority class its requests may claim; higher claims are lowered to it.
    /// Unset: no bound for a named tenant, [`DEFAULT_MAX_PRIORITY`] for the default one.
    pub max_priority: Option<Priority>,
    /// Requests it may start per minute (429 beyond).
    pub requests_per_minute: Option<u32>,
    /// Prompt and output tokens it may use per minute (429 beyond).
    pub tokens_per_minute: Option<u64>,
}

fn one() -> f64 {
    1.0
}

impl Default for TenantSpec {
    fn default() -> Self {
        TenantSpec {
            keys: Vec::new(),
            weight: 1.0,
            max_priority: None,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }
}

/// Why a tenant table was refused: the configuration is refused with its text (the gateway
/// does not start on a table that would send a key's requests to the wrong tenant).
#[derive(Debug, Clone, PartialEq)]
pub enum TenantError {
    /// More than [`MAX_TENANTS`] tenants.
    TooMany,
    /// Keys on the default tenant (it is every request no other tenant names).
    DefaultHasKeys,
    /// An empty key on the named tenant.
    EmptyKey(String),
    /// One key given to two tenants (`first` in table order, then `second`).
    SharedKey {
        /// The tenant that had the key first.
        first: String,
        /// The tenant that named it again.
        second: String,
    },
    /// A weight that is not a positive number, on the named tenant.
    Weight(String),
    /// `tenants` is not a table of `[tenants.NAME]` entries.
    NotATable,
    /// A `[tenants.NAME]` entry that does not read as a [`TenantSpec`].
    Entry {
        /// The entry's name.
        name: String,
        /// What TOML said of it.
        error: toml::de::Error,
    },
}

impl fmt::Display for TenantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantError::TooMany => write!(f, "more than {MAX_TENANTS} tenants"),
            TenantError::DefaultHasKeys => f.write_str(
                "tenant `default` is every request no other tenant names: it takes no keys",
            ),
            TenantError::EmptyKey(name) => write!(f, "tenant `{name}`: an empty key"),
            TenantError::SharedKey { first, second } => write!(
                f,
                "a key is given to both tenant `{first}` and tenant `{second}`"
            ),
            TenantError::Weight(name) => {
                write!(f, "tenant `{name}`: weight must be a positive number")
            }
            TenantError::NotATable => {
                f.write_str("`tenants` must be a table of [tenants.NAME] entries")
            }
            TenantError::Entry { name, error } => write!(f, "[tenants.{name}]: {error}"),
        }
    }
}

impl std::error::Error for TenantError {}

/// The tenant table, built once at start.
#[derive(Debug, Clone)]
pub struct Tenants {
    /// Leaked once at start (at most [`MAX_TENANTS`]): metric labels without an allocation
    /// per request.
    names: Vec<&'static str>,
    specs: Vec<TenantSpec>,
    by_key: HashMap<String, TenantId>,
    by_name: HashMap<String, TenantId>,
}

impl Tenants {
    /// The table of `specs` (by name). The default tenant is always id 0, configured by a
    /// `default` entry when there is one. Refused: keys on the default tenant, a key named by
    /// two tenants, a weight that is not a positive number, more than [`MAX_TENANTS`].
    pub fn new(specs: &[(String, TenantSpec)]) -> Result<Tenants, TenantError> {
        if specs.len() > MAX_TENANTS {
            return Err(TenantError::TooMany);
        }
        let mut default = specs
            .iter()
            .find(|(n, _)| n == DEFAULT_TENANT)
            .map(|(_, s)| s.clone())
            .unwrap_or_default();
        default.max_priority = default.max_priority.or(Some(DEFAULT_MAX_PRIORITY));
        if !default.keys.is_empty() {
            return Err(TenantError::DefaultHasKeys);
        }
        let mut t = Tenants {
            names: vec![DEFAULT_TENANT],
            specs: vec![default],
            by_key: HashMap::new(),
            by_name: HashMap::new(),
        };
        t.by_name.insert(DEFAULT_TENANT.to_string(), 0);
        for (name, spec) in specs.iter().filter(|(n, _)| n != DEFAULT_TENANT) {
            // Within the id range: the table holds at most `MAX_TENANTS` (checked above).
            let id = TenantId::try_from(t.names.len()).map_err(|_| TenantError::TooMany)?;
            for key in &spec.keys {
                if key.is_empty() {
                    return Err(TenantError::EmptyKey(name.clone()));
                }
                if let Some(other) = t.by_key.insert(key.clone(), id) {
                    return Err(TenantError::SharedKey {
                        first: t.names[usize::from(other)].to_string(),
                        second: name.clone(),
                    });
                }
            }
            t.by_name.insert(name.clone(), id);
            t.names.push(Box::leak(name.clone().into_boxed_str()));
            t.specs.push(spec.clone());
        }
        for (name, spec) in t.names.iter().zip(&t.specs) {
            if !(spec.weight.is_finite() && spec.weight > 0.0) {
                return Err(TenantError::Weight(name.to_string()));
            }
        }
        Ok(t)
    }

    /// The tenant of an API key (the default tenant for a key the table does not hold).
    pub fn by_key(&self, key: &str) -> TenantId {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    /// The tenant a trusted front named (the default tenant for a name the table does not hold).
    pub fn by_name(&self, name: &str) -> TenantId {
        self.by_name.get(name).copied().unwrap_or(0)
    }

    /// Tenant `id`'s name (metrics label).
    pub fn name(&self, id: TenantId) -> &'static str {
        self.names
            .get(usize::from(id))
            .copied()
            .unwrap_or(DEFAULT_TENANT)
    }

    /// Tenant `id`'s settings.
    pub fn spec(&self, id: TenantId) -> &TenantSpec {
        self.specs.get(usize::from(id)).unwrap_or(&self.specs[0])
    }

    /// Weights of every tenant by id (for the fairness counters).
    pub fn weights(&self) -> impl Iterator<Item = f64> + '_ {
        self.specs.iter().map(|s| s.weight)
    }

    /// How many tenants (the default one included).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Never true: the default tenant is always there.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A claimed priority, lowered to tenant `id`'s maximum.
    pub fn clamp(&self, id: TenantId, claimed: Priority) -> Priority {
        match self.spec(id).max_priority {
            Some(max) => claimed.min(max),
            None => claimed,
        }
    }
}

/// The `[tenants]` table of a config file's text, if it has one (entries by name, in order).
pub fn from_toml(table: &toml::Table) -> Result<Vec<(String, TenantSpec)>, TenantError> {
    let Some(v) = table.get("tenants") else {
        return Ok(Vec::new());
    };
    let toml::Value::Table(t) = v else {
        return Err(TenantError::NotATable);
    };
    t.iter()
        .map(|(name, spec)| {
            spec.clone()
                .try_into::<TenantSpec>()
                .map(|s| (name.clone(), s))
                .map_err(|error| TenantError::Entry {
                    name: name.clone(),
                    error,
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> Result<Tenants, TenantError> {
        let t: toml::Table = text.parse().expect("the test's TOML parses");
        Tenants::new(&from_toml(&t)?)
    }

    #[test]
    fn keys_and_names_find_their_tenant_and_anything_else_is_the_default() {
        let t = table(
            r#"
            [tenants.chat]
            keys = ["k-chat", "k-chat-2"]
            weight = 3
            max_priority = 10
            [tenants.batch]
            keys = ["k-batch"]
            max_priority = 0
            tokens_per_minute = 1000000
            [tenants.default]
            weight = 0.5
            max_priority = -1
            "#,
        )
        .unwrap();
        assert_eq!(t.len(), 3);
        let chat = t.by_key("k-chat-2");
        assert_eq!(t.name(chat), "chat");
        assert_eq!(t.spec(chat).weight, 3.0);
        assert_eq!(t.name(t.by_key("k-batch")), "batch");
        assert_eq!(t.by_key("someone else"), 0);
        assert_eq!(t.name(0), "default");
        assert_eq!(t.spec(0).weight, 0.5);
        assert_eq!(t.by_name("batch"), t.by_key("k-batch"));
        assert_eq!(t.by_name("nobody"), 0);
        // Ids follow the table's (sorted) order after the default tenant.
        assert_eq!(t.weights().collect::<Vec<_>>(), vec![0.5, 1.0, 3.0]);
        // Clamped to each tenant's maximum, never raised.
        assert_eq!(t.clamp(chat, 50), 10);
        assert_eq!(t.clamp(chat, -5), -5);
        assert_eq!(t.clamp(t.by_key("k-batch"), 10), 0);
        assert_eq!(t.clamp(0, 3), -1);
    }

    #[test]
    fn without_a_default_entry_anonymous_callers_are_clamped_to_0() {
        let t = table("policy = \"cache_aware\"").unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.by_key("any"), 0);
        assert_eq!(t.clamp(0, i32::MAX), 0);
        assert_eq!(t.clamp(0, 99), 0);
        assert_eq!(t.clamp(0, -3), -3, "lowering is always allowed");
        // A named tenant without a bound is not clamped; the default one still is.
        let t = table("[tenants.vip]\nkeys = [\"k\"]").unwrap();
        assert_eq!(t.clamp(t.by_key("k"), 99), 99);
        assert_eq!(t.clamp(t.by_key("someone"), 99), 0);
        // A default entry that says otherwise is obeyed.
        let t = table("[tenants.default]\nmax_priority = 7").unwrap();
        assert_eq!(t.clamp(0, 99), 7);
    }

    #[test]
    fn bad_tables_are_refused_with_the_reason() {
        for (text, why) in [
            ("[tenants.default]\nkeys = [\"k\"]", "takes no keys"),
            (
                "[tenants.a]\nkeys = [\"k\"]\n[tenants.b]\nkeys = [\"k\"]",
                "both tenant",
            ),
            ("[tenants.a]\nweight = 0", "positive"),
            ("[tenants.a]\nweight = -2", "positive"),
            ("[tenants.a]\nkeys = [\"\"]", "empty key"),
            ("[tenants.a]\nwieght = 2", "unknown field"),
            ("tenants = 3", "table"),
        ] {
            let e = table(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
        let many: String = (0..=MAX_TENANTS)
            .map(|i| format!("[tenants.t{i}]\n"))
            .collect();
        assert!(table(&many).unwrap_err().to_string().contains("more than"));
    }
}
