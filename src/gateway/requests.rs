//! Which worker holds each in-flight request, by request id: `POST /abort_request` names a
//! request by its id (the `x-request-id` the gateway echoed), and the abort must reach the
//! engine that runs it, whichever core took the abort. Shared by the cores, sharded so they
//! rarely meet on a lock; bounded in entries (a request past the bound is simply not tracked
//! and its abort goes to every worker); an entry leaves when its request ends.
//!
//! Keys are 64-bit hashes of the id and its caller under a per-process random key: nothing is
//! allocated per request once the shards have grown, a client cannot aim collisions, and an id
//! names a request only for the caller that sent it (the same `Authorization` header, or the
//! same client address when there is none): a leaked or guessed id aborts nobody else's request. A key keeps its
//! latest two workers: in prefill/decode mode both halves of a request run it at once (the
//! prefill may still be computing a long prompt when the abort comes), and after a retry the
//! older one is simply a worker that ignores the abort. A collision (or the same id in flight
//! three times) sends the abort to the latest two holders only.

use crate::base::WorkerId;
use crate::http::RequestHead;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard};

/// Default bound on tracked requests (all cores together).
pub const MAX_TRACKED: usize = 65_536;

const SHARDS: usize = 16;

/// A request id's key in the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdKey(u64);

/// The workers holding a key (the latest, and the one before it), and how many requests in
/// flight share the key.
#[derive(Debug, Clone, Copy)]
struct Holder {
    worker: WorkerId,
    before: Option<WorkerId>,
    count: u32,
}

/// Keys are already random hashes: used as they are.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Shard = HashMap<u64, Holder, BuildHasherDefault<Identity>>;

/// In-flight request ids and their workers (see the module docs).
pub struct InFlightIds {
    hasher: RandomState,
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
}

impl InFlightIds {
    /// A map holding at most about `capacity` requests.
    pub fn new(capacity: usize) -> InFlightIds {
        InFlightIds {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
        }
    }

    /// The key of a request id sent by a caller (computed once per request): the caller is its
    /// `Authorization` header when it has one, else its address.
    pub fn key_for(&self, head: &RequestHead, peer: Option<IpAddr>, request_id: &str) -> IdKey {
        match head.header("authorization") {
            Some(auth) => IdKey(self.hasher.hash_one((0u8, auth, request_id))),
            None => IdKey(self.hasher.hash_one((1u8, peer, request_id))),
        }
    }

    /// The key of a request id for a caller named by a tag alone (tests, tools).
    pub fn key(&self, request_id: &str) -> IdKey {
        IdKey(self.hasher.hash_one((2u8, request_id)))
    }

    fn shard(&self, key: IdKey) -> MutexGuard<'_, Shard> {
        let m = &self.shards[(key.0 % SHARDS as u64) as usize];
        // A panic elsewhere while holding the lock leaves the map consistent (every update
        // is one insert or remove): keep using it.
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `worker` now holds the request: `false` when the map is full (not tracked, so the
    /// caller must not [`remove`](Self::remove) it).
    pub fn insert(&self, key: IdKey, worker: WorkerId) -> bool {
        let mut s = self.shard(key);
        if let Some(h) = s.get_mut(&key.0) {
            if h.worker != worker {
                h.before = Some(h.worker);
                h.worker = worker;
            }
            h.count = h.count.saturating_add(1);
            return true;
        }
        if s.len() >= self.per_shard {
            return false;
        }
        s.insert(
            key.0,
            Holder {
                worker,
                before: None,
                count: 1,
            },
        );
        true
    }

    /// A tracked request ended (or left its worker for a retry).
    pub fn remove(&self, key: IdKey) {
        let mut s = self.shard(key);
        if let Some(h) = s.get_mut(&key.0) {
            h.count = h.count.saturating_sub(1);
            if h.count == 0 {
                s.remove(&key.0);
            }
        }
    }

    /// The worker holding this request id, if it is in flight and tracked, and the worker
    /// that held it before (the prefill half of a prefill/decode request, or the worker of an
    /// earlier attempt).
    pub fn holder(&self, key: IdKey) -> Option<(WorkerId, Option<WorkerId>)> {
        self.shard(key).get(&key.0).map(|h| (h.worker, h.before))
    }

    /// Requests tracked now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }

    /// Nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_until_the_request_ends() {
        let m = InFlightIds::new(100);
        let k = m.key("chatcmpl-1");
        assert!(m.insert(k, 3));
        assert_eq!(m.holder(m.key("chatcmpl-1")), Some((3, None)));
        assert_eq!(m.holder(m.key("chatcmpl-2")), None);
        // A retry moves it: the old attempt's entry goes, the new one stays (the old worker is
        // remembered as the one before, which ignores an abort it does not run).
        assert!(m.insert(k, 5));
        m.remove(k);
        assert_eq!(m.holder(m.key("chatcmpl-1")), Some((5, Some(3))));
        m.remove(k);
        assert_eq!(m.holder(m.key("chatcmpl-1")), None);
        assert!(m.is_empty());
        m.remove(k); // not there: nothing happens
    }

    #[test]
    fn both_halves_of_a_prefill_decode_request_are_held() {
        let m = InFlightIds::new(100);
        let k = m.key("pd-1");
        assert!(m.insert(k, 2)); // prefill
        assert!(m.insert(k, 7)); // decode
        assert_eq!(m.holder(m.key("pd-1")), Some((7, Some(2))));
        // The same worker twice keeps the earlier one.
        assert!(m.insert(k, 7));
        assert_eq!(m.holder(m.key("pd-1")), Some((7, Some(2))));
        for _ in 0..3 {
            m.remove(k);
        }
        assert!(m.is_empty());
    }

    #[test]
    fn an_id_names_a_request_only_for_its_caller() {
        use crate::http::{parse_request_head, HeadLimits};
        let head = |auth: Option<&str>| {
            let mut raw = String::from("POST /x HTTP/1.1\r\nhost: h\r\n");
            if let Some(a) = auth {
                raw.push_str(&format!("authorization: {a}\r\n"));
            }
            raw.push_str("\r\n");
            let mut buf = bytes::BytesMut::from(raw.as_bytes());
            parse_request_head(&mut buf, &HeadLimits::default())
                .unwrap()
                .unwrap()
        };
        let m = InFlightIds::new(100);
        let a: Option<IpAddr> = Some("10.0.0.1".parse().unwrap());
        let b: Option<IpAddr> = Some("10.0.0.2".parse().unwrap());
        let alice = head(Some("Bearer alice"));
        assert!(m.insert(m.key_for(&alice, a, "r1"), 4));
        // The same key from another address is the same caller; another key is not.
        assert_eq!(m.holder(m.key_for(&alice, b, "r1")), Some((4, None)));
        assert_eq!(
            m.holder(m.key_for(&head(Some("Bearer bob")), a, "r1")),
            None
        );
        // Without a key, the address is the caller.
        assert!(m.insert(m.key_for(&head(None), a, "r2"), 5));
        assert_eq!(m.holder(m.key_for(&head(None), a, "r2")), Some((5, None)));
        assert_eq!(m.holder(m.key_for(&head(None), b, "r2")), None);
    }

    #[test]
    fn bounded_in_entries() {
        let m = InFlightIds::new(32);
        let mut tracked = 0;
        for i in 0..10_000 {
            if m.insert(m.key(&format!("req-{i}")), 1) {
                tracked += 1;
            }
        }
        assert!((16..=32).contains(&tracked), "{tracked}");
        assert_eq!(m.len(), tracked);
    }
}
