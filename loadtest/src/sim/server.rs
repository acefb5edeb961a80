//! The network side of the simulated worker: one monoio thread serving every port, each port an
//! independent task set (accept loop, connections, one "GPU" task) around its own [`Engine`].
//!
//! The GPU task plans a forward, sleeps its virtual duration scaled to real time (to an absolute
//! deadline, so timer slack does not accumulate), then applies it and wakes the response tasks
//! of the requests it touched. Response tasks wait on per-request slots (`Rc` + local wakers: all
//! on one thread, nothing crosses threads) while keeping a read pending on the socket, so a
//! client that disconnects aborts its request at once. HTTP framing is radixgate's own pure
//! `radixgate::http` module.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt, OwnedReadHalf, OwnedWriteHalf, Splitable};
use monoio::net::{TcpListener, TcpStream};
use radixgate::http::response::{error_response, render, CONTINUE_100};
use radixgate::http::{parse_request_head, BodyFraming, ChunkedDecoder, HeadLimits, RequestHead};
use serde_json::{json, Value};

use super::api::{self, Completed, Endpoint, RespMeta, StreamRenderer, TokenChunk, Usage};
use super::cost::CostModel;
use super::engine::{Engine, EngineConfig, Event, FinishInfo, FinishReason, ReqId};
use super::tokenizer::{SimTokenizer, TokenizerMode};
use super::{IoDriver, SimConfig};
use crate::rng::Rng;

/// Idle keep-alive timeout between requests (uvicorn's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout for the rest of a request once its first byte arrived.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest request body accepted.
const MAX_BODY: u64 = 64 * 1024 * 1024;
/// Bytes buffered from a client while its response is pending before we stop reading.
const MAX_PIPELINED: usize = 1024 * 1024;
/// Data events written before a `close_mid_stream` fault cuts the stream.
const CUT_AFTER_EVENTS: usize = 3;
/// `/health_generate` gives up after this long (SGLang's `SGLANG_HEALTH_CHECK_TIMEOUT`).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(20);
/// Context length advertised by `/v1/models` and `/get_server_info`.
const CONTEXT_LEN: usize = 131_072;
/// How often the runtime thread checks for a cross-thread shutdown request (monoio without the
/// `sync` feature drops cross-thread wakes, so the flag is polled).
const STOP_POLL: Duration = Duration::from_millis(10);
/// How often a held inference request checks whether `POST /debug/faults` released it.
const HOLD_POLL: Duration = Duration::from_millis(2);

// ---------------------------------------------------------------------------------------------
// Single-thread wake primitives.

/// A one-shot broadcast: once set, every current and future waiter completes. Used for "this
/// server is shutting down / died".
#[derive(Default)]
struct LocalEvent {
    set: Cell<bool>,
    waiters: RefCell<Vec<Option<Waker>>>,
    free: RefCell<Vec<usize>>,
}

impl LocalEvent {
    fn is_set(&self) -> bool {
        self.set.get()
    }

    fn set(&self) {
        self.set.set(true);
        for w in self.waiters.borrow_mut().iter_mut() {
            if let Some(w) = w.take() {
                w.wake();
            }
        }
    }

    fn wait(&self) -> EventWait<'_> {
        EventWait {
            ev: self,
            key: None,
        }
    }
}

/// Future of [`LocalEvent::wait`]; its waker slot is released on drop.
struct EventWait<'a> {
    ev: &'a LocalEvent,
    key: Option<usize>,
}

impl Future for EventWait<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if self.ev.is_set() {
            return Poll::Ready(());
        }
        let mut waiters = self.ev.waiters.borrow_mut();
        match self.key {
            Some(k) => waiters[k] = Some(cx.waker().clone()),
            None => {
                let k = match self.ev.free.borrow_mut().pop() {
                    Some(k) => {
                        waiters[k] = Some(cx.waker().clone());
                        k
                    }
                    None => {
                        waiters.push(Some(cx.waker().clone()));
                        waiters.len() - 1
                    }
                };
                drop(waiters);
                self.key = Some(k);
            }
        }
        Poll::Pending
    }
}

impl Drop for EventWait<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key {
            if let Some(slot) = self.ev.waiters.borrow_mut().get_mut(k) {
                *slot = None;
            }
            self.ev.free.borrow_mut().push(k);
        }
    }
}

/// A single-waiter notification with a sticky flag (the GPU task's "work arrived").
#[derive(Default)]
struct LocalNotify {
    flag: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl LocalNotify {
    fn notify(&self) {
        self.flag.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    async fn wait(&self) {
        poll_fn(|cx| {
            if self.flag.replace(false) {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// What a response task knows about its request; filled by the GPU task.
#[derive(Default)]
struct Slot {
    tokens: RefCell<Vec<u32>>,
    /// Virtual time of the latest token.
    last_at: Cell<f64>,
    cached: Cell<usize>,
    finish: Cell<Option<FinishInfo>>,
    waker: RefCell<Option<Waker>>,
}

impl Slot {
    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Resolves once there are more than `seen` tokens or the request finished.
    async fn changed(&self, seen: usize) {
        poll_fn(|cx| {
            if self.tokens.borrow().len() > seen || self.finish.get().is_some() {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// Per-port server state.

/// One raw request kept for `/debug/requests`.
struct Recorded {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// One simulated worker.
struct Server {
    port: u16,
    port_str: String,
    cfg: Rc<SimConfig>,
    tok: Rc<SimTokenizer>,
    engine: RefCell<Engine>,
    epoch: Instant,
    started_unix: u64,
    gpu_wake: LocalNotify,
    slots: RefCell<HashMap<ReqId, Rc<Slot>>>,
    shutdown: LocalEvent,
    /// Inference requests received / answered (fault counters).
    received: Cell<u64>,
    answered: Cell<u64>,
    fault_rng: RefCell<Rng>,
    records: RefCell<VecDeque<Recorded>>,
    next_id: Cell<u64>,
    /// Connections accepted, and those of them that carried at least one inference request
    /// (`GET /debug/stats`).
    connections: Cell<u64>,
    inference_connections: Cell<u64>,
    /// Inference requests received and not yet finished (held, delayed, stalled or generating).
    in_progress: Cell<u64>,
    /// Run-time fault knobs (`POST /debug/faults`): `fail_rate` replaces the configured one;
    /// `hold` keeps new and waiting inference requests from being handled until it is cleared.
    fail_rate_override: Cell<Option<f64>>,
    hold: Cell<bool>,
}

/// Counts an inference request as in progress while it lives.
struct InProgress<'a>(&'a Cell<u64>);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Server {
    fn new(port: u16, index: usize, cfg: Rc<SimConfig>, tok: Rc<SimTokenizer>) -> Self {
        let cost = CostModel {
            fixed_step_ms: cfg.token_interval_ms,
            ..CostModel::default()
        };
        let seed = cfg.seed.wrapping_add(index as u64);
        let engine = Engine::new(EngineConfig {
            max_total_tokens: cfg.max_total_tokens,
            page_size: cfg.page_size,
            chunked_prefill_size: cfg.chunked_prefill_size,
            max_running: cfg.max_running,
            cost,
            // Answers depend on the prompt and the cluster seed only, so every worker generates
            // the same reply to the same prompt (routing does not change the conversation).
            seed: cfg.seed,
            output_vocab: tok.output_vocab(),
        });
        Server {
            port,
            port_str: port.to_string(),
            cfg,
            tok,
            engine: RefCell::new(engine),
            epoch: Instant::now(),
            started_unix: unix_now() as u64,
            gpu_wake: LocalNotify::default(),
            slots: RefCell::new(HashMap::new()),
            shutdown: LocalEvent::default(),
            received: Cell::new(0),
            answered: Cell::new(0),
            fault_rng: RefCell::new(Rng::new(seed ^ 0xFA11_0000)),
            records: RefCell::new(VecDeque::new()),
            next_id: Cell::new(1),
            connections: Cell::new(0),
            inference_connections: Cell::new(0),
            in_progress: Cell::new(0),
            fail_rate_override: Cell::new(None),
            hold: Cell::new(false),
        }
    }

    /// The fail rate in force: the run-time override, else the configured one.
    fn fail_rate(&self) -> f64 {
        self.fail_rate_override
            .get()
            .unwrap_or(self.cfg.faults.fail_rate)
    }

    /// `spawn_cluster` validated it to be finite and positive.
    fn scale(&self) -> f64 {
        self.cfg.time_scale
    }

    /// Real time since start mapped to virtual ms.
    fn virt_now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0 * self.scale()
    }

    /// Real instant at which virtual time `ms` is reached.
    fn real_at(&self, ms: f64) -> Instant {
        self.epoch + Duration::from_secs_f64((ms / 1000.0 / self.scale()).max(0.0))
    }

    fn die(&self) {
        self.shutdown.set();
        self.gpu_wake.notify();
    }

    fn next_resp_id(&self, prefix: &str) -> String {
        let n = self.next_id.get();
        self.next_id.set(n + 1);
        format!("{prefix}{:08x}{n:08x}", self.port as u32 ^ 0x5eed)
    }

    /// Queue a request, stamping its arrival on the virtual clock: now, if the GPU is idle;
    /// otherwise real time clamped into the forward in flight.
    fn submit(
        &self,
        prompt: Vec<u32>,
        max_new: usize,
        internal: bool,
    ) -> Result<(ReqId, Rc<Slot>), String> {
        let mut e = self.engine.borrow_mut();
        let v = self.virt_now();
        let arrival = match e.inflight_ms() {
            None => {
                e.advance_to(v);
                e.now_ms()
            }
            Some(d) => v.clamp(e.now_ms(), e.now_ms() + d),
        };
        let id = e
            .submit(prompt, max_new, arrival, internal)
            .map_err(|err| err.to_string())?;
        drop(e);
        let slot = Rc::new(Slot::default());
        slot.last_at.set(arrival);
        self.slots.borrow_mut().insert(id, slot.clone());
        self.gpu_wake.notify();
        Ok((id, slot))
    }

    fn abort(&self, id: ReqId) {
        if self.slots.borrow_mut().remove(&id).is_some() {
            self.engine.borrow_mut().abort(id);
        }
    }

    fn dispatch(&self, events: &[Event]) {
        let mut slots = self.slots.borrow_mut();
        for ev in events {
            match *ev {
                Event::Token {
                    id,
                    token,
                    first,
                    at_ms,
                } => {
                    if let Some(s) = slots.get(&id) {
                        if first {
                            s.cached
                                .set(self.engine.borrow().cached_tokens(id).unwrap_or(0));
                        }
                        s.tokens.borrow_mut().push(token);
                        s.last_at.set(at_ms);
                        s.wake();
                    }
                }
                Event::Finished { id, info } => {
                    if let Some(s) = slots.remove(&id) {
                        s.cached.set(info.cached_tokens);
                        s.finish.set(Some(info));
                        s.wake();
                    }
                }
            }
        }
    }

    fn record(&self, head: &RequestHead, body: &[u8]) {
        let keep = self.cfg.record_requests;
        if keep == 0 || head.path().starts_with(b"/debug/") {
            return;
        }
        let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut r = self.records.borrow_mut();
        while r.len() >= keep {
            r.pop_front();
        }
        r.push_back(Recorded {
            method: s(head.method()),
            target: s(head.target()),
            headers: head.headers().map(|(n, v)| (s(n), s(v))).collect(),
            body: s(body),
        });
    }
}

/// The virtual GPU: plan, sleep the scaled duration, apply, wake.
async fn gpu_loop(sh: Rc<Server>) {
    let mut events = Vec::new();
    while !sh.shutdown.is_set() {
        let planned = sh.engine.borrow_mut().plan();
        let Some(f) = planned else {
            monoio::select! {
                _ = sh.gpu_wake.wait() => {}
                _ = sh.shutdown.wait() => return,
            }
            continue;
        };
        let end = sh.engine.borrow().now_ms() + f.duration_ms;
        let deadline = sh.real_at(end);
        if deadline > Instant::now() {
            monoio::select! {
                _ = monoio::time::sleep_until(deadline.into()) => {}
                _ = sh.shutdown.wait() => return,
            }
        }
        events.clear();
        sh.engine.borrow_mut().complete(&mut events);
        sh.dispatch(&events);
    }
}

// ---------------------------------------------------------------------------------------------
// Connection I/O.

type ReadHalf = OwnedReadHalf<TcpStream>;
type WriteHalf = OwnedWriteHalf<TcpStream>;
type PendingRead = Pin<Box<dyn Future<Output = (io::Result<usize>, Vec<u8>, ReadHalf)>>>;

/// The read side of a connection. A read, once started, stays pending (owned by `pending`)
/// until it completes, even if the future awaiting it is dropped: no received byte is lost when
/// a wait for request events wins a race against the socket.
struct Reader {
    rd: Option<ReadHalf>,
    pending: Option<PendingRead>,
    spare: Vec<u8>,
    buf: BytesMut,
    eof: bool,
}

impl Reader {
    fn new(rd: ReadHalf) -> Self {
        Reader {
            rd: Some(rd),
            pending: None,
            spare: Vec::with_capacity(16 * 1024),
            buf: BytesMut::new(),
            eof: false,
        }
    }

    /// Read more bytes into `buf`. `Ok(0)` means the peer closed (or half-closed) its side.
    async fn fill(&mut self) -> io::Result<usize> {
        if self.eof {
            return Ok(0);
        }
        if self.pending.is_none() {
            let Some(mut rd) = self.rd.take() else {
                return Ok(0);
            };
            let mut b = std::mem::take(&mut self.spare);
            b.clear();
            if b.capacity() < 16 * 1024 {
                b.reserve(16 * 1024);
            }
            self.pending = Some(Box::pin(async move {
                let (r, b) = rd.read(b).await;
                (r, b, rd)
            }));
        }
        let Some(fut) = self.pending.as_mut() else {
            return Ok(0);
        };
        let (r, b, rd) = fut.await;
        self.pending = None;
        self.rd = Some(rd);
        let n = match r {
            Ok(n) => n,
            Err(e) => {
                self.spare = b;
                self.eof = true;
                return Err(e);
            }
        };
        self.buf.extend_from_slice(&b[..n]);
        self.spare = b;
        if n == 0 {
            self.eof = true;
        }
        Ok(n)
    }

    /// Resolves when the client disconnects (EOF or error); bytes it sends meanwhile
    /// (pipelined requests) are buffered, up to a cap after which we stop reading.
    async fn disconnected(&mut self) {
        loop {
            if self.buf.len() > MAX_PIPELINED {
                std::future::pending::<()>().await;
            }
            match self.fill().await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

async fn write(wr: &mut WriteHalf, data: Bytes) -> io::Result<()> {
    let (r, _) = wr.write_all(data).await;
    r.map(|_| ())
}

/// Aborts the requests of a response task that ends early (disconnect, write error, fault,
/// shutdown): whatever path leaves the handler, no request outlives its client.
struct AbortGuard {
    sh: Rc<Server>,
    ids: Vec<ReqId>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        for &id in &self.ids {
            self.sh.abort(id);
        }
    }
}

enum Next {
    KeepAlive,
    Close,
}

enum HeadRead {
    Head(Box<RequestHead>),
    Closed,
    Error(u16, &'static str),
}

async fn read_head(sh: &Server, r: &mut Reader) -> HeadRead {
    let limits = HeadLimits::default();
    loop {
        match parse_request_head(&mut r.buf, &limits) {
            Ok(Some(h)) => return HeadRead::Head(Box::new(h)),
            Ok(None) => {}
            Err(e) => return HeadRead::Error(e.status(), e.message()),
        }
        let limit = if r.buf.is_empty() {
            IDLE_TIMEOUT
        } else {
            REQUEST_TIMEOUT
        };
        monoio::select! {
            res = monoio::time::timeout(limit, r.fill()) => match res {
                Ok(Ok(n)) if n > 0 => {}
                _ => return HeadRead::Closed,
            },
            _ = sh.shutdown.wait() => return HeadRead::Closed,
        }
    }
}

async fn read_body(
    sh: &Server,
    head: &RequestHead,
    r: &mut Reader,
) -> Result<Bytes, Option<(u16, &'static str)>> {
    match head.framing {
        BodyFraming::None | BodyFraming::Close => Ok(Bytes::new()),
        BodyFraming::Length(n) => {
            if n > MAX_BODY {
                return Err(Some((413, "request body too large")));
            }
            let n = n as usize;
            while r.buf.len() < n {
                fill_or_stop(sh, r).await?;
            }
            Ok(r.buf.split_to(n).freeze())
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(MAX_BODY);
            let mut body = BytesMut::new();
            loop {
                let used = dec
                    .feed(&r.buf, &mut body)
                    .map_err(|e| Some((e.status(), e.message())))?;
                let _ = r.buf.split_to(used);
                if dec.is_done() {
                    return Ok(body.freeze());
                }
                fill_or_stop(sh, r).await?;
            }
        }
    }
}

async fn fill_or_stop(sh: &Server, r: &mut Reader) -> Result<(), Option<(u16, &'static str)>> {
    monoio::select! {
        res = monoio::time::timeout(REQUEST_TIMEOUT, r.fill()) => match res {
            Ok(Ok(n)) if n > 0 => Ok(()),
            _ => Err(None),
        },
        _ = sh.shutdown.wait() => Err(None),
    }
}

async fn connection(sh: Rc<Server>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut reader = Reader::new(rd);
    sh.connections.set(sh.connections.get() + 1);
    let mut carried_inference = false;
    loop {
        let head = match read_head(&sh, &mut reader).await {
            HeadRead::Head(h) => h,
            HeadRead::Closed => return,
            HeadRead::Error(status, msg) => {
                respond_error(&sh, &mut wr, false, status, "BadRequestError", msg).await;
                return;
            }
        };
        if head.expect_continue
            && !matches!(head.framing, BodyFraming::None)
            && write(&mut wr, Bytes::from_static(CONTINUE_100))
                .await
                .is_err()
        {
            return;
        }
        let body = match read_body(&sh, &head, &mut reader).await {
            Ok(b) => b,
            Err(Some((status, msg))) => {
                respond_error(&sh, &mut wr, false, status, "BadRequestError", msg).await;
                return;
            }
            Err(None) => return,
        };
        sh.record(&head, &body);
        if !carried_inference
            && matches!(
                head.path(),
                b"/generate" | b"/v1/chat/completions" | b"/v1/completions"
            )
        {
            carried_inference = true;
            sh.inference_connections
                .set(sh.inference_connections.get() + 1);
        }
        let next = handle(&sh, &head, &body, &mut reader, &mut wr).await;
        if matches!(next, Next::Close) || !head.keep_alive || sh.shutdown.is_set() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Routing and handlers.

async fn respond(
    sh: &Server,
    wr: &mut WriteHalf,
    keep: bool,
    status: u16,
    ctype: &str,
    body: &[u8],
) -> Next {
    let resp = render(
        status,
        ctype,
        &[("x-worker-port", &sh.port_str)],
        body,
        !keep,
    );
    match write(wr, resp).await {
        Ok(()) if keep => Next::KeepAlive,
        _ => Next::Close,
    }
}

async fn respond_json(sh: &Server, wr: &mut WriteHalf, keep: bool, status: u16, v: &Value) -> Next {
    let body = serde_json::to_vec(v).unwrap_or_default();
    respond(sh, wr, keep, status, "application/json", &body).await
}

async fn respond_error(
    sh: &Server,
    wr: &mut WriteHalf,
    keep: bool,
    status: u16,
    kind: &str,
    msg: &str,
) -> Next {
    let resp = error_response(status, kind, msg, &[("x-worker-port", &sh.port_str)], !keep);
    match write(wr, resp).await {
        Ok(()) if keep => Next::KeepAlive,
        _ => Next::Close,
    }
}

async fn handle(
    sh: &Rc<Server>,
    head: &RequestHead,
    body: &[u8],
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    let keep = head.keep_alive;
    let method = head.method();
    if method == b"HEAD" {
        // Only GET/POST APIs exist; a HEAD answer must not carry a body.
        let resp = render(
            405,
            "application/json",
            &[("x-worker-port", &sh.port_str)],
            b"",
            !keep,
        );
        return match write(wr, resp).await {
            Ok(()) if keep => Next::KeepAlive,
            _ => Next::Close,
        };
    }
    let get = method == b"GET";
    let post = method == b"POST";
    match head.path() {
        b"/generate" if post || method == b"PUT" => {
            inference(sh, head, Endpoint::Generate, body, r, wr).await
        }
        b"/v1/chat/completions" if post => inference(sh, head, Endpoint::Chat, body, r, wr).await,
        b"/v1/completions" if post => inference(sh, head, Endpoint::Completions, body, r, wr).await,
        b"/health" if get => {
            if sh.cfg.faults.health_fail {
                respond(sh, wr, keep, 503, "text/plain", b"").await
            } else {
                respond(sh, wr, keep, 200, "text/plain", b"").await
            }
        }
        b"/health_generate" if get => health_generate(sh, keep, r, wr).await,
        b"/v1/models" if get => respond_json(sh, wr, keep, 200, &models(sh)).await,
        b"/get_model_info" | b"/model_info" if get => {
            respond_json(sh, wr, keep, 200, &model_info(sh)).await
        }
        b"/get_server_info" | b"/server_info" if get => {
            respond_json(sh, wr, keep, 200, &server_info(sh)).await
        }
        b"/get_load" if get => respond_json(sh, wr, keep, 200, &get_load(sh)).await,
        b"/v1/loads" if get => respond_json(sh, wr, keep, 200, &loads(sh)).await,
        b"/flush_cache" if get || post => {
            let ok = sh.engine.borrow_mut().flush_cache();
            let text = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n";
            respond(
                sh,
                wr,
                keep,
                if ok { 200 } else { 400 },
                "text/plain; charset=utf-8",
                text.as_bytes(),
            )
            .await
        }
        b"/metrics" if get => {
            let text = sh.engine.borrow().render_metrics(&sh.cfg.model_name);
            respond(
                sh,
                wr,
                keep,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.as_bytes(),
            )
            .await
        }
        b"/debug/requests" if get => respond_json(sh, wr, keep, 200, &debug_requests(sh)).await,
        b"/debug/stats" if get => respond_json(sh, wr, keep, 200, &debug_stats(sh)).await,
        b"/debug/faults" if post => match set_faults(sh, body) {
            Ok(()) => respond_json(sh, wr, keep, 200, &debug_stats(sh)).await,
            Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
        },
        b"/generate"
        | b"/v1/chat/completions"
        | b"/v1/completions"
        | b"/health"
        | b"/health_generate"
        | b"/v1/models"
        | b"/get_model_info"
        | b"/model_info"
        | b"/get_server_info"
        | b"/server_info"
        | b"/get_load"
        | b"/v1/loads"
        | b"/flush_cache"
        | b"/metrics"
        | b"/debug/requests"
        | b"/debug/stats"
        | b"/debug/faults" => {
            respond_json(sh, wr, keep, 405, &json!({"detail": "Method Not Allowed"})).await
        }
        _ => respond_json(sh, wr, keep, 404, &json!({"detail": "Not Found"})).await,
    }
}

fn models(sh: &Server) -> Value {
    let m = &sh.cfg.model_name;
    json!({"object": "list", "data": [{
        "id": m, "object": "model", "created": sh.started_unix, "owned_by": "sglang",
        "root": m, "parent": null, "max_model_len": CONTEXT_LEN,
    }]})
}

fn model_info(sh: &Server) -> Value {
    let m = &sh.cfg.model_name;
    json!({
        "model_path": m, "tokenizer_path": m, "is_generation": true,
        "preferred_sampling_params": null, "weight_version": "default",
        "served_model_name": m, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    })
}

fn server_info(sh: &Server) -> Value {
    let c = &sh.cfg;
    let e = sh.engine.borrow();
    let tokenizer = match c.tokenizer {
        TokenizerMode::Bpe => "bpe",
        TokenizerMode::Approx => "approx",
    };
    json!({
        "model_path": c.model_name, "tokenizer_path": c.model_name, "served_model_name": c.model_name,
        "host": c.host, "port": sh.port, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
        "page_size": c.page_size, "chunked_prefill_size": c.chunked_prefill_size,
        "max_prefill_tokens": 16384, "max_running_requests": c.max_running,
        "max_total_tokens": c.max_total_tokens, "schedule_policy": "fcfs",
        "radix_eviction_policy": "lru", "disable_radix_cache": false, "enable_metrics": true,
        "enable_cache_report": true, "context_length": CONTEXT_LEN, "stream_interval": 1,
        "random_seed": c.seed, "kv_cache_dtype": "auto", "dtype": "bfloat16",
        "max_total_num_tokens": c.max_total_tokens,
        "max_req_input_len": c.max_total_tokens.saturating_sub(1).min(CONTEXT_LEN),
        "internal_states": [{
            "last_gen_throughput": e.gen_throughput(),
            "num_running_reqs": e.num_running(),
            "num_waiting_reqs": e.num_waiting(),
            "token_usage": e.cache().used_tokens() as f64 / c.max_total_tokens.max(1) as f64,
            "cache_hit_rate": e.last_hit_rate(),
            "memory_usage": {"kvcache_tokens": e.cache().tree_tokens() + e.cache().private_tokens()},
        }],
        "version": "0.5.2-sim",
        "simulator": {
            "time_scale": c.time_scale, "tokenizer": tokenizer,
            "token_interval_ms": c.token_interval_ms, "default_max_tokens": c.default_max_tokens,
        },
    })
}

fn get_load(sh: &Server) -> Value {
    let e = sh.engine.borrow();
    json!([{
        "dp_rank": 0,
        "num_reqs": e.num_running() + e.num_waiting(),
        "num_waiting_reqs": e.num_waiting(),
        "num_tokens": e.cache().used_tokens(),
        "num_pending_tokens": e.waiting_tokens(),
        "ts_tic": unix_now(),
    }])
}

fn loads(sh: &Server) -> Value {
    let e = sh.engine.borrow();
    let cap = sh.cfg.max_total_tokens.max(1);
    let used = e.cache().used_tokens();
    json!({
        "timestamp": unix_now(), "version": "0.5.2-sim", "accelerator": "sim", "num_accelerators": 1,
        "loads": [{
            "dp_rank": 0, "num_running_reqs": e.num_running(), "num_waiting_reqs": e.num_waiting(),
            "num_waiting_uncached_tokens": e.waiting_tokens(), "num_used_tokens": used,
            "num_total_tokens": e.cache().tree_tokens() + e.cache().private_tokens(),
            "max_total_num_tokens": cap, "token_usage": used as f64 / cap as f64,
            "gen_throughput": e.gen_throughput(), "cache_hit_rate": e.last_hit_rate(),
            "utilization": if e.is_idle() { 0.0 } else { 1.0 },
        }],
    })
}

fn debug_requests(sh: &Server) -> Value {
    Value::Array(
        sh.records
            .borrow()
            .iter()
            .map(|r| {
                json!({
                    "method": r.method,
                    "path": r.target,
                    "headers": r.headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>(),
                    "body": r.body,
                })
            })
            .collect(),
    )
}

fn debug_stats(sh: &Server) -> Value {
    json!({
        "port": sh.port,
        "connections": sh.connections.get(),
        "inference_connections": sh.inference_connections.get(),
        "inference_received": sh.received.get(),
        "inference_answered": sh.answered.get(),
        "inference_in_progress": sh.in_progress.get(),
        "fail_rate": sh.fail_rate(),
        "hold": sh.hold.get(),
    })
}

/// `POST /debug/faults` with `{"fail_rate": 0.0..=1.0 | null, "hold": bool}` (each optional;
/// `fail_rate: null` restores the configured rate).
fn set_faults(sh: &Server, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let Some(obj) = v.as_object() else {
        return Err("expected a JSON object".into());
    };
    if let Some(f) = obj.get("fail_rate") {
        let rate = match f {
            Value::Null => None,
            v => match v.as_f64() {
                Some(r) if (0.0..=1.0).contains(&r) => Some(r),
                _ => return Err("fail_rate must be within [0, 1] or null".into()),
            },
        };
        sh.fail_rate_override.set(rate);
    }
    if let Some(h) = obj.get("hold") {
        sh.hold
            .set(h.as_bool().ok_or("hold must be true or false")?);
    }
    Ok(())
}

async fn health_generate(sh: &Rc<Server>, keep: bool, r: &mut Reader, wr: &mut WriteHalf) -> Next {
    if sh.cfg.faults.health_fail {
        return respond(sh, wr, keep, 503, "text/plain", b"").await;
    }
    if sh
        .cfg
        .faults
        .stall_after
        .is_some_and(|n| sh.received.get() > n)
    {
        // A wedged scheduler never produces the probe's token either.
        stall(sh, r).await;
        return Next::Close;
    }
    let (id, slot) = match sh.submit(vec![0], 1, true) {
        Ok(x) => x,
        Err(_) => return respond(sh, wr, keep, 503, "text/plain", b"").await,
    };
    let _guard = AbortGuard {
        sh: sh.clone(),
        ids: vec![id],
    };
    let ok = monoio::select! {
        res = monoio::time::timeout(HEALTH_TIMEOUT, slot.changed(0)) => res.is_ok(),
        _ = r.disconnected() => return Next::Close,
        _ = sh.shutdown.wait() => return Next::Close,
    };
    respond(sh, wr, keep, if ok { 200 } else { 503 }, "text/plain", b"").await
}

/// Hold a request forever (until the client leaves or the server stops).
async fn stall(sh: &Server, r: &mut Reader) {
    monoio::select! {
        _ = r.disconnected() => {}
        _ = sh.shutdown.wait() => {}
    }
}

/// Count an answered inference request; the `die_after`-th one kills the server.
fn answered(sh: &Server) {
    let n = sh.answered.get() + 1;
    sh.answered.set(n);
    if sh.cfg.faults.die_after.is_some_and(|limit| n >= limit) {
        sh.die();
    }
}

async fn inference(
    sh: &Rc<Server>,
    head: &RequestHead,
    ep: Endpoint,
    body: &[u8],
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    let keep = head.keep_alive;
    let faults = &sh.cfg.faults;
    let count = sh.received.get() + 1;
    sh.received.set(count);
    sh.in_progress.set(sh.in_progress.get() + 1);
    let _in_progress = InProgress(&sh.in_progress);
    while sh.hold.get() {
        monoio::select! {
            _ = monoio::time::sleep(HOLD_POLL) => {}
            _ = r.disconnected() => return Next::Close,
            _ = sh.shutdown.wait() => return Next::Close,
        }
    }
    if faults.die_after.is_some_and(|n| count > n) {
        sh.die();
        return Next::Close;
    }
    if faults.stall_after.is_some_and(|n| count > n) {
        stall(sh, r).await;
        return Next::Close;
    }
    if faults.latency_ms > 0 {
        monoio::select! {
            _ = monoio::time::sleep(Duration::from_millis(faults.latency_ms)) => {}
            _ = r.disconnected() => return Next::Close,
            _ = sh.shutdown.wait() => return Next::Close,
        }
    }
    let fail_rate = sh.fail_rate();
    if fail_rate > 0.0 && sh.fault_rng.borrow_mut().chance(fail_rate) {
        let next = respond_error(
            sh,
            wr,
            keep,
            500,
            "InternalServerError",
            "simulated worker failure (fail_rate)",
        )
        .await;
        answered(sh);
        return next;
    }
    let req = match api::parse_inference(ep, body, &sh.tok, sh.cfg.default_max_tokens) {
        Ok(req) => req,
        Err(e) => {
            let next = respond_error(sh, wr, keep, 400, "BadRequestError", &e.message).await;
            answered(sh);
            return next;
        }
    };
    let mut guard = AbortGuard {
        sh: sh.clone(),
        ids: Vec::with_capacity(req.prompts.len()),
    };
    let mut slots = Vec::with_capacity(req.prompts.len());
    let mut prompt_lens = Vec::with_capacity(req.prompts.len());
    for p in req.prompts {
        prompt_lens.push(p.len());
        match sh.submit(p, req.max_new_tokens, false) {
            Ok((id, slot)) => {
                guard.ids.push(id);
                slots.push(slot);
            }
            Err(msg) => {
                drop(guard);
                let next = respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await;
                answered(sh);
                return next;
            }
        }
    }
    let model = req.model.unwrap_or_else(|| sh.cfg.model_name.clone());
    let id = match ep {
        Endpoint::Chat => sh.next_resp_id("chatcmpl-"),
        Endpoint::Completions => sh.next_resp_id("cmpl-"),
        Endpoint::Generate => req.rid.unwrap_or_else(|| sh.next_resp_id("")),
    };
    let created = unix_now() as u64;
    let next = if req.stream {
        let renderer = StreamRenderer::new(ep, id, created, model, req.include_usage);
        stream_response(sh, head, renderer, &slots[0], prompt_lens[0], r, wr).await
    } else {
        // Wait for every prompt of the request, watching for the client leaving.
        for slot in &slots {
            loop {
                if slot.finish.get().is_some() {
                    break;
                }
                let seen = slot.tokens.borrow().len();
                monoio::select! {
                    _ = slot.changed(seen) => {}
                    _ = r.disconnected() => return Next::Close,
                    _ = sh.shutdown.wait() => return Next::Close,
                }
            }
        }
        let results: Vec<Completed> = slots
            .iter()
            .filter_map(|s| s.finish.get().map(|info| (s, info)))
            .map(|(s, info)| {
                let ids = s.tokens.borrow().clone();
                Completed {
                    text: sh.tok.decode_output(&ids),
                    output_ids: ids,
                    usage: Usage::from_info(&info),
                    e2e_latency: (info.finish_ms - info.arrival_ms) / 1000.0,
                    aborted: info.reason == FinishReason::Abort,
                }
            })
            .collect();
        let body = api::render_completed(
            ep,
            &RespMeta {
                id: &id,
                created,
                model: &model,
            },
            &results,
        );
        respond(sh, wr, keep, 200, "application/json", &body).await
    };
    // The guard aborts whatever did not finish (disconnect, cut stream); finished requests
    // already left the slot registry, so it is a no-op for them.
    drop(guard);
    if slots.iter().all(|s| s.finish.get().is_some()) {
        answered(sh);
    }
    next
}

async fn stream_response(
    sh: &Rc<Server>,
    head: &RequestHead,
    mut renderer: StreamRenderer,
    slot: &Slot,
    prompt_len: usize,
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    // HTTP/1.0 has no chunked coding: the stream is delimited by closing the connection.
    let chunked = head.minor_version >= 1;
    let mut h = String::with_capacity(192);
    h.push_str("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\nx-worker-port: ");
    h.push_str(&sh.port_str);
    h.push_str(if chunked {
        "\r\ntransfer-encoding: chunked\r\n"
    } else {
        "\r\nconnection: close\r\n"
    });
    if chunked && !head.keep_alive {
        h.push_str("connection: close\r\n");
    }
    h.push_str("\r\n");
    if write(wr, Bytes::from(h.into_bytes())).await.is_err() {
        return Next::Close;
    }
    let arrival = slot.last_at.get();
    let mut seen = 0;
    let mut events_sent = 0;
    let mut text = String::with_capacity(4096);
    let mut piece = String::with_capacity(32);
    loop {
        text.clear();
        let finish = slot.finish.get();
        {
            let tokens = slot.tokens.borrow();
            let at = slot.last_at.get();
            while seen < tokens.len() {
                let token = tokens[seen];
                seen += 1;
                piece.clear();
                sh.tok.push_output_text(token, &mut piece);
                let usage = Usage {
                    prompt_tokens: prompt_len,
                    completion_tokens: seen,
                    cached_tokens: slot.cached.get(),
                };
                let last = finish.is_some() && seen == tokens.len();
                let fin = if last {
                    finish.map(|i| i.reason == FinishReason::Abort)
                } else {
                    None
                };
                renderer.token(
                    &mut text,
                    &TokenChunk {
                        token,
                        piece: &piece,
                        first: seen == 1,
                        usage,
                        e2e: (at - arrival) / 1000.0,
                        finish: fin,
                    },
                );
                events_sent += 1;
            }
        }
        if let Some(info) = finish {
            let aborted = info.reason == FinishReason::Abort;
            renderer.finish(
                &mut text,
                &Usage::from_info(&info),
                (info.finish_ms - info.arrival_ms) / 1000.0,
                aborted,
                seen,
            );
        }
        let cut = sh.cfg.faults.close_mid_stream && events_sent >= CUT_AFTER_EVENTS;
        if !text.is_empty() {
            let mut out = Vec::with_capacity(text.len() + 16);
            if chunked {
                out.extend_from_slice(format!("{:x}\r\n", text.len()).as_bytes());
                out.extend_from_slice(text.as_bytes());
                out.extend_from_slice(b"\r\n");
                if finish.is_some() && !cut {
                    out.extend_from_slice(b"0\r\n\r\n");
                }
            } else {
                out.extend_from_slice(text.as_bytes());
            }
            if write(wr, Bytes::from(out)).await.is_err() {
                return Next::Close;
            }
        }
        if cut {
            // Fault: drop the connection without the terminating chunk.
            return Next::Close;
        }
        if finish.is_some() {
            return if chunked && head.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            };
        }
        monoio::select! {
            _ = slot.changed(seen) => {}
            _ = r.disconnected() => return Next::Close,
            _ = sh.shutdown.wait() => return Next::Close,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cluster lifecycle.

async fn accept_loop(sh: Rc<Server>, listener: TcpListener) {
    loop {
        monoio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    monoio::spawn(connection(sh.clone(), stream));
                }
                Err(_) => {
                    // EMFILE and friends: back off instead of spinning.
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = sh.shutdown.wait() => break,
        }
    }
    // Dropping the listener closes the port: connection refused from now on.
    drop(listener);
}

/// Reports the outcome of runtime start-up (driver name, or why it failed) to `spawn_cluster`.
type Ready = std::sync::mpsc::Sender<io::Result<&'static str>>;

async fn serve(
    cfg: Rc<SimConfig>,
    listeners: Vec<std::net::TcpListener>,
    stop: Arc<AtomicBool>,
    ready: Ready,
    driver: &'static str,
) {
    // Built before reporting ready, so the first request does not pay for the vocabulary.
    let tok = Rc::new(SimTokenizer::new(cfg.tokenizer));
    let mut servers = Vec::with_capacity(listeners.len());
    let mut registered = Vec::with_capacity(listeners.len());
    for std_l in listeners {
        let port = std_l.local_addr().map(|a| a.port()).unwrap_or(0);
        match TcpListener::from_std(std_l) {
            Ok(l) => registered.push((port, l)),
            Err(e) => {
                let msg = format!("cannot register listener on port {port}: {e}");
                let _ = ready.send(Err(io::Error::new(e.kind(), msg)));
                return;
            }
        }
    }
    for (i, (port, listener)) in registered.into_iter().enumerate() {
        let sh = Rc::new(Server::new(port, i, cfg.clone(), tok.clone()));
        monoio::spawn(gpu_loop(sh.clone()));
        monoio::spawn(accept_loop(sh.clone(), listener));
        servers.push(sh);
    }
    let _ = ready.send(Ok(driver));
    while !stop.load(Ordering::Acquire) {
        monoio::time::sleep(STOP_POLL).await;
    }
    for sh in &servers {
        sh.die();
    }
    // Let tasks observe the shutdown and close their sockets before the runtime drops them.
    monoio::time::sleep(Duration::from_millis(5)).await;
}

fn run_runtime(
    driver: IoDriver,
    cfg: SimConfig,
    listeners: Vec<std::net::TcpListener>,
    stop: Arc<AtomicBool>,
    ready: Ready,
) {
    // `Auto` picks a driver exactly as monoio's `FusionDriver` does (io_uring when the kernel has
    // the ops monoio needs and `MONOIO_FORCE_LEGACY_DRIVER` is not set, else epoll), so every
    // choice ends up on one concrete driver and one code path.
    let uring = match driver {
        IoDriver::Auto => monoio::utils::detect_uring(),
        IoDriver::Uring => true,
        IoDriver::Legacy => false,
    };
    if uring {
        let rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .enable_timer()
            .build();
        serve_on(rt, "io_uring", driver, cfg, listeners, stop, ready);
    } else {
        let rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build();
        serve_on(rt, "legacy", driver, cfg, listeners, stop, ready);
    }
}

/// Run the workers on a freshly built runtime (`name` is the driver reported to
/// [`SimCluster`]), or report through `ready` why the `requested` driver could not start.
fn serve_on<D: monoio::Driver>(
    rt: io::Result<monoio::Runtime<D>>,
    name: &'static str,
    requested: IoDriver,
    cfg: SimConfig,
    listeners: Vec<std::net::TcpListener>,
    stop: Arc<AtomicBool>,
    ready: Ready,
) {
    match rt {
        Ok(mut rt) => rt.block_on(serve(Rc::new(cfg), listeners, stop, ready, name)),
        Err(e) => {
            let msg = format!("cannot start the monoio runtime ({requested:?} driver): {e}");
            let _ = ready.send(Err(io::Error::new(e.kind(), msg)));
        }
    }
}

/// A running simulated cluster: one worker per port on a background thread. Dropping it (or
/// [`shutdown`](Self::shutdown)) stops every worker and closes the ports.
pub struct SimCluster {
    ports: Vec<u16>,
    host: String,
    driver: &'static str,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCluster")
            .field("host", &self.host)
            .field("ports", &self.ports)
            .field("io_driver", &self.driver)
            .finish()
    }
}

impl SimCluster {
    /// Bound ports, in configuration order (ephemeral ones resolved).
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `http://host:port` per worker.
    pub fn urls(&self) -> Vec<String> {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        self.ports
            .iter()
            .map(|p| format!("http://{host}:{p}"))
            .collect()
    }

    /// Stop all workers and wait for the serving thread to exit (ports closed on return).
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    /// Block until the serving thread exits (after a stop requested through
    /// [`stopper`](Self::stopper)). Errors if the thread panicked.
    pub fn join(mut self) -> io::Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| io::Error::other("sim-worker thread panicked")),
            None => Ok(()),
        }
    }

    /// The monoio driver in use: `"io_uring"` or `"legacy"` (epoll).
    pub fn io_driver(&self) -> &'static str {
        self.driver
    }

    /// A handle that stops the cluster from another thread (signal handlers, tests).
    pub fn stopper(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Bind every port (so clients can connect as soon as this returns), then serve them all on one
/// background monoio thread.
pub fn spawn_cluster(cfg: SimConfig) -> io::Result<SimCluster> {
    let invalid = |msg: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, msg.to_owned()));
    if cfg.ports.is_empty() {
        return invalid("no ports configured");
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return invalid("time_scale must be a positive number");
    }
    if cfg
        .token_interval_ms
        .is_some_and(|ms| !(ms.is_finite() && ms >= 0.0))
    {
        return invalid("token_interval_ms must be a non-negative number");
    }
    if !(0.0..=1.0).contains(&cfg.faults.fail_rate) {
        return invalid("fail_rate must be within [0, 1]");
    }
    let mut listeners = Vec::with_capacity(cfg.ports.len());
    let mut ports = Vec::with_capacity(cfg.ports.len());
    for &p in &cfg.ports {
        // Names ("localhost") and bare IPv6 literals resolve through ToSocketAddrs.
        let l = std::net::TcpListener::bind((cfg.host.as_str(), p))
            .map_err(|e| io::Error::new(e.kind(), format!("bind {}:{p}: {e}", cfg.host)))?;
        l.set_nonblocking(true)?;
        ports.push(l.local_addr()?.port());
        listeners.push(l);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let driver = cfg.io_driver;
    let host = cfg.host.clone();
    let stop2 = stop.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("sim-worker".into())
        .spawn(move || run_runtime(driver, cfg, listeners, stop2, ready_tx))?;
    // Wait until the runtime runs and every listener is registered, so a failure (io_uring not
    // permitted, ...) is reported here rather than as refused connections later.
    let started = ready_rx
        .recv()
        .unwrap_or_else(|_| Err(io::Error::other("sim-worker thread exited during start-up")));
    match started {
        Ok(driver) => Ok(SimCluster {
            ports,
            host,
            driver,
            stop,
            thread: Some(thread),
        }),
        Err(e) => {
            let _ = thread.join();
            Err(e)
        }
    }
}
