//! Cache namespaces: SGLang's radix cache shares a prefix only between requests with the same
//! `(extra_key, cache_salt)`, where a LoRA adapter is part of the extra key. The simulated tree
//! keys its root children by a namespace seed, and the seed also starts the namespace's page-hash
//! chain, so equal tokens in two namespaces are two different blocks, as in SGLang's events.

use std::sync::Arc;

use crate::rng::mix64;

/// Seed of the default namespace's page-hash chain (the "hash" of the empty prefix), so the
/// first page's hash is not a plain hash of its tokens.
pub(super) const ROOT_HASH_SEED: u64 = 0x6b76_5f72_6f6f_7400;

/// What a namespace's `BlockStored` events carry (SGLang publishes the salt and the adapter's
/// name, not a caller's `extra_key`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NsTags {
    /// `cache_salt` of the requests that stored the blocks.
    pub cache_salt: Option<Arc<str>>,
    /// Name of the LoRA adapter the blocks were computed with.
    pub lora_name: Option<Arc<str>>,
}

/// A request's cache namespace. The default one (no extra key, adapter or salt) is what every
/// request used before namespaces existed, with the same page hashes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// Keys the root's children and starts the page-hash chain.
    seed: u64,
    /// Event fields; `None` for a namespace with neither salt nor adapter.
    tags: Option<Arc<NsTags>>,
}

impl Default for Namespace {
    fn default() -> Self {
        Namespace {
            seed: ROOT_HASH_SEED,
            tags: None,
        }
    }
}

impl Namespace {
    /// The namespace of a request with these fields. Empty strings count as absent, as SGLang
    /// normalises `extra_key` and `cache_salt` (`value or None`).
    pub fn new(extra_key: Option<&str>, lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let (extra_key, lora_name, cache_salt) =
            (present(extra_key), present(lora_name), present(cache_salt));
        if extra_key.is_none() && lora_name.is_none() && cache_salt.is_none() {
            return Namespace::default();
        }
        // Presence and length go into the hash, so ("a", "bc") and ("ab", "c") differ, and so
        // does an extra key that happens to equal an adapter's name.
        let mut h = mix64(ROOT_HASH_SEED ^ 0x6e73);
        for part in [extra_key, lora_name, cache_salt] {
            h = hash_part(h, part);
        }
        let tags = (lora_name.is_some() || cache_salt.is_some()).then(|| {
            Arc::new(NsTags {
                cache_salt: cache_salt.map(Arc::from),
                lora_name: lora_name.map(Arc::from),
            })
        });
        Namespace { seed: h, tags }
    }

    /// Whether this is the namespace of a request without extra key, adapter or salt.
    pub fn is_default(&self) -> bool {
        self.seed == ROOT_HASH_SEED
    }

    /// The seed that keys the namespace in the tree and starts its hash chain.
    pub(super) fn seed(&self) -> u64 {
        self.seed
    }

    /// The event fields of the namespace's blocks.
    pub fn tags(&self) -> Option<&Arc<NsTags>> {
        self.tags.as_ref()
    }
}

/// `s` unless it is empty.
fn present(s: Option<&str>) -> Option<&str> {
    s.filter(|s| !s.is_empty())
}

/// Fold one optional string into `h`: a presence marker, then its length and bytes.
fn hash_part(mut h: u64, part: Option<&str>) -> u64 {
    let Some(s) = part else {
        return mix64(h ^ 0xA5);
    };
    h = mix64(h ^ 0x5A ^ ((s.len() as u64) << 8));
    for chunk in s.as_bytes().chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix64(h ^ u64::from_le_bytes(word));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_differ_by_every_field_and_empty_means_absent() {
        let d = Namespace::default();
        assert!(d.is_default() && d.tags().is_none());
        assert_eq!(Namespace::new(Some(""), None, Some("")), d);
        let all = [
            Namespace::new(Some("k"), None, None),
            Namespace::new(None, Some("k"), None),
            Namespace::new(None, None, Some("k")),
            Namespace::new(Some("a"), None, Some("bc")),
            Namespace::new(Some("ab"), None, Some("c")),
            Namespace::new(None, Some("a"), Some("b")),
        ];
        for (i, a) in all.iter().enumerate() {
            assert!(!a.is_default());
            assert_ne!(a.seed(), d.seed());
            for b in &all[i + 1..] {
                assert_ne!(a.seed(), b.seed(), "{a:?} vs {b:?}");
            }
        }
        assert_eq!(all[0], Namespace::new(Some("k"), None, None), "stable");
        // An extra key alone is not published; salt and adapter are.
        assert!(all[0].tags().is_none());
        let t = all[5].tags().unwrap();
        assert_eq!(
            (t.lora_name.as_deref(), t.cache_salt.as_deref()),
            (Some("a"), Some("b"))
        );
    }
}
