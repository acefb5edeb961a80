//! Where and for how long a prompt is tokenized for KV-event routing. Encoding costs 0.35–1.8 ms
//! of a core per KiB of new text (see `tokenize::Limits`), so a serving core must never spend a
//! large prompt's worth on one request: every other connection of that core would wait.
//!
//! - A prompt of at most [`INLINE_MAX_BYTES`] is encoded on the serving core, through the core's
//!   piece cache (a conversation's earlier turns cost a lookup), within [`INLINE_BUDGET`].
//! - A larger one, or a small one that ran out of its inline time, goes to the tokenizer helper
//!   threads (low priority, their own piece caches); the request waits for the ids, polling on a
//!   timer (a serving core never awaits a channel another thread fills: monoio drops such
//!   wakes), until [`HELPER_BUDGET`] passes, then routes by the text tree. The helpers stop
//!   encoding at the same deadline.
//! - Each core has at most [`HELPER_SLOTS_PER_CORE`] prompts in the helpers' hands; past that,
//!   or with the helpers' queue full, the request routes by text at once.
//!
//! A request is tokenized once ([`prompt_tokens`]), whatever number of picks it then needs
//! (retries, circuits that refuse).

use super::kv_routing::{parse_token_ids, Fallback, KvRouting, SEGMENT_CACHE_TOKENS};
use super::Core;
use crate::route::extract::{Api, MAX_ROUTING_TEXT};
use crate::tokenize::{SegmentCache, TokenizeError, Tokenizer};
use bytes::Bytes;
use crossbeam::channel::{self, Receiver, Sender, TryRecvError, TrySendError};
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest prompt (chat body, or text) encoded on the serving core.
pub const INLINE_MAX_BYTES: usize = 64 << 10;
/// Longest a serving core encodes one prompt (looked at between pieces and runs of at most
/// 1 KiB of new words: a core is held at most ~2 ms past it).
pub const INLINE_BUDGET: Duration = Duration::from_millis(2);
/// Longest a request waits for the helpers (queueing included) before it routes by text: a
/// 512 KiB prompt of prose (the size cap) encodes in about 0.2 s.
pub const HELPER_BUDGET: Duration = Duration::from_millis(500);
/// Prompts one core may have in the helpers' hands at once.
pub const HELPER_SLOTS_PER_CORE: usize = 2;
/// Jobs queued per helper thread beyond the one it encodes.
const QUEUE_PER_HELPER: usize = 4;
/// First and longest pause between two looks for a helper's answer.
const POLL_FIRST: Duration = Duration::from_micros(100);
const POLL_MAX: Duration = Duration::from_millis(2);

/// What a helper encodes.
enum Prompt {
    /// A `/v1/chat/completions` body: rendered through the chat template, then encoded.
    Chat(Bytes),
    /// A completions prompt or `/generate` text.
    Text(String),
}

/// A prompt for a helper, its deadline, and where the ids go.
struct Job {
    prompt: Prompt,
    deadline: Instant,
    answer: Sender<Result<Vec<u32>, TokenizeError>>,
}

/// The tokenizer helper threads: a bounded queue in front of a few low-priority threads, each
/// with its own piece cache.
pub struct TokenizerPool {
    jobs: Sender<Job>,
}

impl TokenizerPool {
    /// `threads` helpers (at least one) encoding with `tok`. A thread that cannot start is
    /// logged; with none, every job is refused and prompts route by text.
    pub fn start(tok: &Arc<Tokenizer>, threads: usize) -> TokenizerPool {
        let threads = threads.max(1);
        let (jobs, queue) = channel::bounded::<Job>(threads * QUEUE_PER_HELPER);
        for i in 0..threads {
            let queue = queue.clone();
            let tok = tok.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("radixgate-tokenize-{i}"))
                .spawn(move || helper(&tok, &queue));
            if let Err(e) = spawned {
                crate::log!(Warn, "tokenizer helper {i}: cannot start: {e}");
            }
        }
        TokenizerPool { jobs }
    }

    /// Queue a prompt; `None` when the queue is full (or no helper runs).
    fn submit(
        &self,
        prompt: Prompt,
        deadline: Instant,
    ) -> Option<Receiver<Result<Vec<u32>, TokenizeError>>> {
        let (answer, rx) = channel::bounded(1);
        match self.jobs.try_send(Job {
            prompt,
            deadline,
            answer,
        }) {
            Ok(()) => Some(rx),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => None,
        }
    }
}

/// A helper thread's loop: jobs until the pool goes.
fn helper(tok: &Arc<Tokenizer>, queue: &Receiver<Job>) {
    if let Err(e) = crate::base::priority::helper_thread() {
        crate::log!(Warn, "tokenizer helper: cannot lower its priority: {e}");
    }
    let mut cache = SegmentCache::new(tok.clone(), SEGMENT_CACHE_TOKENS);
    while let Ok(job) = queue.recv() {
        // Waited out its budget in the queue: the request has routed by text already.
        if Instant::now() >= job.deadline {
            let _ = job.answer.send(Err(TokenizeError::TooSlow));
            continue;
        }
        cache.set_deadline(Some(job.deadline));
        let mut out = Vec::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &job.prompt {
            Prompt::Chat(body) => cache.chat_ids(body, &mut out),
            Prompt::Text(text) => cache.text_ids(text, &mut out),
        }));
        let r = match r {
            Ok(r) => r.map(|()| out),
            Err(_) => {
                // A panic inside the tokenizer library: this cache may be half updated.
                cache = SegmentCache::new(tok.clone(), SEGMENT_CACHE_TOKENS);
                Err(TokenizeError::Encode("tokenizer panicked".into()))
            }
        };
        // The request may have stopped waiting: nobody to tell.
        let _ = job.answer.send(r);
    }
}

/// A core's place among the prompts it has with the helpers, given back when dropped.
struct HelperSlot<'a>(&'a Cell<usize>);

impl HelperSlot<'_> {
    /// One of the core's [`HELPER_SLOTS_PER_CORE`] places (`held` counts them), if one is free.
    fn take(held: &Cell<usize>) -> Option<HelperSlot<'_>> {
        if held.get() >= HELPER_SLOTS_PER_CORE {
            return None;
        }
        held.set(held.get() + 1);
        Some(HelperSlot(held))
    }
}

impl Drop for HelperSlot<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// This request's prompt in the servers' token ids (see the module doc for where it is
/// encoded), or why the text tree decides instead. `text` is the routing text the extractor
/// built (capped: a longer text prompt is measured on its first `MAX_ROUTING_TEXT` bytes);
/// with `token_ids` it holds a token-id prompt (after its namespace's marker, if any).
pub async fn prompt_tokens(
    core: &Core,
    kv: &KvRouting,
    api: Api,
    body: &Bytes,
    text: &str,
    token_ids: bool,
) -> Result<Vec<u32>, Fallback> {
    if token_ids {
        let mut ids = Vec::with_capacity(text.len() / 4);
        parse_token_ids(text, MAX_ROUTING_TEXT, &mut ids)?;
        return Ok(ids);
    }
    let Some(tok) = kv.tokenizer() else {
        return Err(Fallback::NoTokenizer);
    };
    let size = match api {
        Api::Chat => body.len(),
        Api::Completions | Api::Generate => text.len(),
        // Its prompt is token ids only (`token_ids` above); none: nothing to measure.
        Api::TokenGenerate => return Err(Fallback::BadTokenIds),
        // Their prompts are the worker's chat template over converted items: the text tree
        // decides.
        Api::Embeddings | Api::Rerank | Api::Responses | Api::Messages => {
            return Err(Fallback::OtherApi)
        }
    };
    if size <= INLINE_MAX_BYTES {
        match encode_inline(core, tok, api, body, text) {
            Err(TokenizeError::TooSlow) => {} // New text past the inline budget: the helpers.
            r => return r.map_err(tokenize_fallback),
        }
    }
    let Some(pool) = kv.tokenizer_pool() else {
        return Err(Fallback::TokenizerBusy);
    };
    let Some(_slot) = HelperSlot::take(&core.kv_helper_jobs) else {
        return Err(Fallback::TokenizerBusy);
    };
    let deadline = Instant::now() + HELPER_BUDGET;
    let prompt = match api {
        Api::Chat => Prompt::Chat(body.clone()),
        _ => Prompt::Text(text.to_string()),
    };
    let Some(answer) = pool.submit(prompt, deadline) else {
        return Err(Fallback::TokenizerBusy);
    };
    let mut pause = POLL_FIRST;
    loop {
        match answer.try_recv() {
            Ok(r) => return r.map_err(tokenize_fallback),
            Err(TryRecvError::Disconnected) => return Err(Fallback::Tokenize),
            Err(TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Fallback::TokenizeBudget);
        }
        monoio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// Encode on this core, within [`INLINE_BUDGET`].
fn encode_inline(
    core: &Core,
    tok: &Arc<Tokenizer>,
    api: Api,
    body: &[u8],
    text: &str,
) -> Result<Vec<u32>, TokenizeError> {
    let mut s = core.kv.borrow_mut();
    let cache = s
        .segments
        .get_or_insert_with(|| SegmentCache::new(tok.clone(), SEGMENT_CACHE_TOKENS));
    cache.set_deadline(Some(Instant::now() + INLINE_BUDGET));
    let mut out = Vec::new();
    let r = match api {
        Api::Chat => cache.chat_ids(body, &mut out),
        _ => cache.text_ids(text, &mut out),
    };
    cache.set_deadline(None);
    r.map(|()| out)
}

/// Why the tokenizer gave no ids, as a fallback reason (logged at debug: the reason is counted).
fn tokenize_fallback(e: TokenizeError) -> Fallback {
    crate::log!(Debug, "kv events: prompt not tokenized ({e}); text tree");
    match e {
        TokenizeError::TooSlow => Fallback::TokenizeBudget,
        _ => Fallback::Tokenize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let dir = std::env::temp_dir().join(format!("radixgate-pool-tok-{}", std::process::id()));
        crate::tokenize::folder::small_llama3_folder(&dir).unwrap();
        Arc::new(Tokenizer::from_path(&dir).unwrap())
    }

    fn wait(rx: &Receiver<Result<Vec<u32>, TokenizeError>>) -> Result<Vec<u32>, TokenizeError> {
        rx.recv_timeout(Duration::from_secs(20)).unwrap()
    }

    #[test]
    fn a_core_holds_at_most_its_share_of_helper_places() {
        let held = Cell::new(0);
        let a = HelperSlot::take(&held).unwrap();
        let _b = HelperSlot::take(&held).unwrap();
        assert!(HELPER_SLOTS_PER_CORE == 2 && HelperSlot::take(&held).is_none());
        drop(a);
        assert!(
            HelperSlot::take(&held).is_some(),
            "a place given back is taken again"
        );
        assert_eq!(held.get(), 1, "the temporary place went back at once");
    }

    #[test]
    fn helpers_encode_as_the_core_would_and_refuse_what_they_cannot_take() {
        let tok = tokenizer();
        let pool = TokenizerPool::start(&tok, 1);
        let far = Instant::now() + Duration::from_secs(20);
        let rx = pool
            .submit(Prompt::Text("hello there".into()), far)
            .unwrap();
        let mut want = Vec::new();
        SegmentCache::new(tok.clone(), 1 << 10)
            .text_ids("hello there", &mut want)
            .unwrap();
        assert_eq!(wait(&rx), Ok(want));
        // A job whose deadline passed in the queue is not encoded.
        let rx = pool
            .submit(Prompt::Text("late".into()), Instant::now())
            .unwrap();
        assert_eq!(wait(&rx), Err(TokenizeError::TooSlow));
        // A bounded queue: with the helper held by a long job, the queue fills and the next is
        // refused at once (the request then routes by text).
        let long: String = (0..40_000).map(|i| format!("z{i:x} ")).collect();
        let mut held = vec![pool.submit(Prompt::Text(long), far).unwrap()];
        let mut refused = false;
        for _ in 0..=QUEUE_PER_HELPER + 1 {
            match pool.submit(Prompt::Text("x".into()), far) {
                Some(rx) => held.push(rx),
                None => refused = true,
            }
        }
        assert!(refused, "a full queue takes no more");
        for rx in &held {
            assert!(wait(rx).is_ok());
        }
    }
}
