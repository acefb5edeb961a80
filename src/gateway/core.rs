//! One serving core's private state: never shared between threads, so no locks.

use super::Gateway;
use crate::base::rng::Rng;
use crate::proxy::pool::Pool;
use std::cell::RefCell;
use std::sync::Arc;

/// Idle upstream connections kept per worker on one core.
const POOL_PER_WORKER: usize = 64;

/// One core's private state.
pub struct Core {
    /// The state every core shares.
    pub gw: Arc<Gateway>,
    /// Which serving core this is (core 0 also runs policy upkeep).
    pub index: usize,
    /// This core's idle upstream connections.
    pub pool: Pool,
    /// This core's random source (ties, jitter, request ids).
    pub rng: RefCell<Rng>,
    /// This core's kernel randomness, for what clients must not predict (request ids).
    pub entropy: RefCell<crate::base::entropy::Entropy>,
    /// This core's last `/v1/models` merge (the list answered) and when it was made.
    pub models_cache: RefCell<Option<(std::time::Instant, serde_json::Value)>>,
    /// This core's buffers for measuring prompts against the KV-event index.
    pub kv: RefCell<super::kv_routing::KvScratch>,
    /// Prompts of this core's requests the tokenizer helpers hold now (bounded: see
    /// `gateway::tokenizing`).
    pub kv_helper_jobs: std::cell::Cell<usize>,
    /// This core's busy-poll window (`--busy-poll-us`).
    pub busy: super::busy_poll::BusyPoll,
}

impl Core {
    /// A core bound to the shared gateway.
    pub fn new(gw: Arc<Gateway>, index: usize) -> Core {
        let pool = upstream_pool(&gw);
        let busy = super::busy_poll::BusyPoll::new(gw.settings.cores.busy_poll);
        Core {
            gw,
            index,
            pool,
            rng: RefCell::new(Rng::from_entropy()),
            entropy: RefCell::default(),
            models_cache: RefCell::default(),
            kv: RefCell::default(),
            kv_helper_jobs: std::cell::Cell::new(0),
            busy,
        }
    }
}

/// An empty upstream pool with the configured idle timeout (for a core or a helper thread);
/// the gateway's own calls through it carry `--worker-api-key`.
pub fn upstream_pool(gw: &Gateway) -> Pool {
    let upstream = &gw.settings.upstream;
    Pool::new(
        upstream.idle_timeout,
        POOL_PER_WORKER,
        upstream.worker_api_key.as_deref(),
    )
}
