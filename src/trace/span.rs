//! What a serving core records: finished spans as plain values ([`SpanRecord`]), and one
//! request's spans while it lives ([`RequestTrace`]). No OpenTelemetry types here: the SDK's
//! `SpanData` (and its allocations for attribute keys, scope and resource) is built on the
//! export thread, so a core pays only for these small structs and one queue push per span.

use super::context::{format_traceparent, TraceParent, TRACEPARENT_LEN};
use super::tracestate::bound_tracestate;
use crate::base::entropy::Entropy;
use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

/// The role of a span, as OTLP's `SpanKind` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request as the gateway served it.
    Server,
    /// A phase inside the gateway.
    Internal,
    /// One upstream attempt (the worker's spans are its children).
    Client,
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Text (a fixed name, or e.g. a worker URL).
    Str(Cow<'static, str>),
    /// A count or a status code.
    Int(i64),
    /// A flag.
    Bool(bool),
}

impl From<&'static str> for Value {
    fn from(s: &'static str) -> Value {
        Value::Str(Cow::Borrowed(s))
    }
}

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Str(Cow::Owned(s))
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Bool(v)
    }
}

/// One finished span, ready for the export thread.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    /// The trace it belongs to.
    pub trace_id: [u8; 16],
    /// Its own id.
    pub span_id: [u8; 8],
    /// Its parent (all zero: a root span).
    pub parent_id: [u8; 8],
    /// The parent is the caller's span (another process).
    pub parent_remote: bool,
    /// Its role.
    pub kind: Kind,
    /// Its name (fixed names only: span names must have low cardinality).
    pub name: &'static str,
    /// Start, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// Attributes, in the order they were set.
    pub attrs: Vec<(&'static str, Value)>,
    /// Instants within the span (first byte, end of stream): (name, nanoseconds since epoch).
    pub events: Vec<(&'static str, u64)>,
    /// Why the span failed, when it did.
    pub error: Option<Cow<'static, str>>,
    /// The caller's `tracestate`, kept on the server span: valid and bounded
    /// ([`bound_tracestate`]), at most 512 bytes.
    pub trace_state: Option<Box<str>>,
}

impl SpanRecord {
    /// About the bytes this record holds: the struct and what it owns on the heap (attribute
    /// and event slots, owned strings), what a core's queue counts it at against
    /// `--trace-buffer-bytes`.
    pub fn held_bytes(&self) -> usize {
        // Only an owned string is held by the record (a borrowed one is a static name).
        let owned = |s: &Cow<'static, str>| match s {
            Cow::Owned(s) => s.capacity(),
            Cow::Borrowed(_) => 0,
        };
        std::mem::size_of::<SpanRecord>()
            + self.attrs.capacity() * std::mem::size_of::<(&'static str, Value)>()
            + self
                .attrs
                .iter()
                .map(|(_, v)| match v {
                    Value::Str(s) => owned(s),
                    Value::Int(_) | Value::Bool(_) => 0,
                })
                .sum::<usize>()
            + self.events.capacity() * std::mem::size_of::<(&'static str, u64)>()
            + self.error.as_ref().map_or(0, owned)
            + self.trace_state.as_ref().map_or(0, |s| s.len())
    }
}

/// Now, in nanoseconds since the Unix epoch (OTLP's timestamps): a vDSO clock read.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A random id from the kernel's CSPRNG (ids must not be guessable, and never all zero).
fn random_id<const N: usize>(entropy: &mut Entropy) -> [u8; N] {
    loop {
        let mut id = [0u8; N];
        for b in &mut id {
            *b = entropy.byte();
        }
        if id != [0u8; N] {
            return id;
        }
    }
}

/// A new trace's id: 128 random bits from the kernel's CSPRNG, never all zero.
pub fn random_trace_id(entropy: &mut Entropy) -> [u8; 16] {
    random_id(entropy)
}

/// Spans a request usually has (server, admit, route, attempt): one allocation for them all.
const USUAL_SPANS: usize = 4;

/// One sampled request's trace while it is served: the server span's state, and the child
/// spans finished so far. Exists only for a recorded request (`None` otherwise), so a request
/// that is not traced costs one branch.
#[derive(Debug)]
pub struct RequestTrace {
    /// The server span (ended and filled in by [`RequestTrace::finish`]).
    root: SpanRecord,
    /// Finished child spans.
    children: Vec<SpanRecord>,
    /// The upstream attempts in progress, by [`Leg`] (their ids are already upstream in
    /// `traceparent`): one for a regular request, both while a PD pair is out.
    attempts: [Option<SpanRecord>; 2],
}

/// Which open attempt span: a regular request has one; a prefill/decode attempt has one per
/// side, both open at once (the two requests run concurrently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// The attempt of a regular request, or the prefill side of a PD pair.
    Prefill = 0,
    /// The decode side of a PD pair.
    Decode = 1,
}

impl RequestTrace {
    /// A recorded request's trace: the caller's trace continued under its span when it sent a
    /// valid context (with its `tracestate`, bounded), else a new random trace.
    /// `new_trace` is the id a new trace gets (from [`random_trace_id`]; ignored when the
    /// caller's trace is continued).
    pub fn begin(
        caller: Option<&TraceParent>,
        new_trace: [u8; 16],
        trace_state: Option<&[u8]>,
        entropy: &mut Entropy,
        start_ns: u64,
    ) -> RequestTrace {
        let (trace_id, parent_id, remote) = match caller {
            Some(tp) => (tp.trace_id, tp.parent_id, true),
            None => (new_trace, [0; 8], false),
        };
        // `tracestate` belongs to the caller's context: kept only when that context is.
        let trace_state = caller
            .and(trace_state)
            .and_then(bound_tracestate)
            .map(String::into_boxed_str);
        RequestTrace {
            root: SpanRecord {
                trace_id,
                span_id: random_id(entropy),
                parent_id,
                parent_remote: remote,
                kind: Kind::Server,
                name: "radixgate.request",
                start_ns,
                end_ns: start_ns,
                attrs: Vec::with_capacity(8),
                events: Vec::new(),
                error: None,
                trace_state,
            },
            children: Vec::with_capacity(USUAL_SPANS),
            attempts: [None, None],
        }
    }

    /// Whether the caller's trace is continued (its `tracestate` then goes upstream too).
    pub fn continued(&self) -> bool {
        self.root.parent_remote
    }

    /// The caller's `tracestate` as kept (valid, at most 512 bytes and 32 members): what the
    /// upstream request carries in place of the client's header.
    pub fn trace_state(&self) -> Option<&str> {
        self.root.trace_state.as_deref()
    }

    /// The span `leg`'s upstream request names as its parent: that leg's attempt in progress,
    /// else the server span.
    pub fn upstream_parent_of(&self, leg: Leg) -> &[u8; 8] {
        self.attempts[leg as usize]
            .as_ref()
            .map_or(&self.root.span_id, |a| &a.span_id)
    }

    /// Open an upstream attempt span (a client span; any attempt still open ends now).
    pub fn start_attempt(
        &mut self,
        entropy: &mut Entropy,
        start_ns: u64,
        attrs: Vec<(&'static str, Value)>,
    ) {
        self.end_attempt(start_ns, None);
        self.open_leg(Leg::Prefill, entropy, start_ns, attrs);
    }

    /// Open the two attempt spans of a prefill/decode pair, sent at once (any attempt still
    /// open ends now).
    pub fn start_pair_attempt(
        &mut self,
        entropy: &mut Entropy,
        start_ns: u64,
        prefill: Vec<(&'static str, Value)>,
        decode: Vec<(&'static str, Value)>,
    ) {
        self.end_attempt(start_ns, None);
        self.open_leg(Leg::Prefill, entropy, start_ns, prefill);
        self.open_leg(Leg::Decode, entropy, start_ns, decode);
    }

    fn open_leg(
        &mut self,
        leg: Leg,
        entropy: &mut Entropy,
        start_ns: u64,
        attrs: Vec<(&'static str, Value)>,
    ) {
        self.attempts[leg as usize] = Some(SpanRecord {
            trace_id: self.root.trace_id,
            span_id: random_id(entropy),
            parent_id: self.root.span_id,
            parent_remote: false,
            kind: Kind::Client,
            name: "attempt",
            start_ns,
            end_ns: start_ns,
            attrs,
            events: Vec::new(),
            error: None,
            trace_state: None,
        });
    }

    /// Add an attribute to the attempt in progress.
    pub fn attempt_set(&mut self, key: &'static str, value: impl Into<Value>) {
        self.leg_set(Leg::Prefill, key, value);
    }

    /// Add an attribute to `leg`'s attempt in progress.
    pub fn leg_set(&mut self, leg: Leg, key: &'static str, value: impl Into<Value>) {
        if let Some(a) = self.attempts[leg as usize].as_mut() {
            a.attrs.push((key, value.into()));
        }
    }

    /// End every attempt in progress at `end_ns` (failed when `error` says why).
    pub fn end_attempt(&mut self, end_ns: u64, error: Option<Cow<'static, str>>) {
        self.end_leg(Leg::Decode, end_ns, error.clone());
        self.end_leg(Leg::Prefill, end_ns, error);
    }

    /// End `leg`'s attempt in progress at `end_ns` (failed when `error` says why).
    pub fn end_leg(&mut self, leg: Leg, end_ns: u64, error: Option<Cow<'static, str>>) {
        if let Some(mut a) = self.attempts[leg as usize].take() {
            a.end_ns = end_ns.max(a.start_ns);
            if error.is_some() {
                a.error = error;
            }
            self.children.push(a);
        }
    }

    /// The trace id.
    pub fn trace_id(&self) -> &[u8; 16] {
        &self.root.trace_id
    }

    /// The server span's id.
    pub fn root_id(&self) -> &[u8; 8] {
        &self.root.span_id
    }

    /// A new span id for a child whose id must be known before it ends (an attempt, whose id
    /// goes upstream in `traceparent`).
    pub fn new_span_id(&self, entropy: &mut Entropy) -> [u8; 8] {
        random_id(entropy)
    }

    /// The `traceparent` naming `span_id` as the parent, for the upstream request.
    pub fn traceparent_for(&self, span_id: &[u8; 8]) -> [u8; TRACEPARENT_LEN] {
        format_traceparent(&self.root.trace_id, span_id, true)
    }

    /// Add an attribute to the server span.
    pub fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        self.root.attrs.push((key, value.into()));
    }

    /// Add an event (an instant) to the server span.
    pub fn event(&mut self, name: &'static str, at_ns: u64) {
        self.root.events.push((name, at_ns));
    }

    /// Mark the server span failed.
    pub fn fail(&mut self, why: impl Into<Cow<'static, str>>) {
        self.root.error = Some(why.into());
    }

    /// Record a finished child of the server span with a fresh id (phases whose id nobody
    /// needs beforehand).
    pub fn child(
        &mut self,
        entropy: &mut Entropy,
        name: &'static str,
        start_ns: u64,
        end_ns: u64,
        attrs: Vec<(&'static str, Value)>,
    ) {
        let id = random_id(entropy);
        self.child_with_id(id, Kind::Internal, name, start_ns, end_ns, attrs, None);
    }

    /// Record a finished child of the server span with a known id (an attempt).
    #[allow(clippy::too_many_arguments)]
    pub fn child_with_id(
        &mut self,
        span_id: [u8; 8],
        kind: Kind,
        name: &'static str,
        start_ns: u64,
        end_ns: u64,
        attrs: Vec<(&'static str, Value)>,
        error: Option<Cow<'static, str>>,
    ) {
        self.children.push(SpanRecord {
            trace_id: self.root.trace_id,
            span_id,
            parent_id: self.root.span_id,
            parent_remote: false,
            kind,
            name,
            start_ns,
            end_ns: end_ns.max(start_ns),
            attrs,
            events: Vec::new(),
            error,
            trace_state: None,
        });
    }

    /// End the server span at `end_ns`: every span of the request, the server span last.
    pub fn finish(mut self, end_ns: u64) -> impl Iterator<Item = SpanRecord> {
        self.end_attempt(end_ns, None);
        self.root.end_ns = end_ns.max(self.root.start_ns);
        self.children.into_iter().chain(std::iter::once(self.root))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::context::parse_traceparent;

    #[test]
    fn a_callers_trace_is_continued_under_its_span() {
        let tp =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let mut e = Entropy::default();
        let mut t = RequestTrace::begin(Some(&tp), [0; 16], Some(b"k=v"), &mut e, 10);
        let attempt = t.new_span_id(&mut e);
        let header = t.traceparent_for(&attempt);
        let seen = parse_traceparent(&header).unwrap();
        assert_eq!(seen.trace_id, tp.trace_id);
        assert_eq!(seen.parent_id, attempt);
        assert!(seen.sampled());
        t.child(&mut e, "admit", 10, 12, vec![]);
        t.child_with_id(attempt, Kind::Client, "attempt", 12, 11, vec![], None);
        let spans: Vec<_> = t.finish(20).collect();
        assert_eq!(spans.len(), 3);
        let root = spans.last().unwrap();
        assert_eq!(root.parent_id, tp.parent_id);
        assert!(root.parent_remote);
        assert_eq!(root.trace_state.as_deref(), Some("k=v"));
        assert_eq!((root.start_ns, root.end_ns), (10, 20));
        for c in &spans[..2] {
            assert_eq!(c.parent_id, root.span_id);
            assert_eq!(c.trace_id, tp.trace_id);
            assert!(c.end_ns >= c.start_ns);
        }
    }

    #[test]
    fn a_new_trace_has_random_ids_and_no_parent() {
        let mut e = Entropy::default();
        let a = RequestTrace::begin(None, random_trace_id(&mut e), Some(b"k=v"), &mut e, 1);
        let b = RequestTrace::begin(None, random_trace_id(&mut e), None, &mut e, 1);
        assert_ne!(a.trace_id(), b.trace_id());
        assert_ne!(a.trace_id(), &[0; 16]);
        assert_ne!(a.root_id(), &[0; 8]);
        let root = a.finish(0).last().unwrap();
        assert_eq!(root.parent_id, [0; 8]);
        // No caller context: its tracestate is not carried.
        assert_eq!(root.trace_state, None);
        assert_eq!(root.end_ns, 1);
    }

    #[test]
    fn a_callers_tracestate_is_kept_bounded_or_not_at_all() {
        let tp =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let mut e = Entropy::default();
        let long: Vec<String> = (0..2000)
            .map(|i| format!("k{i}={}", "v".repeat(25)))
            .collect();
        let long = long.join(",");
        let t = RequestTrace::begin(Some(&tp), [0; 16], Some(long.as_bytes()), &mut e, 1);
        let kept = t.trace_state().unwrap();
        assert!(kept.len() <= 512 && long.starts_with(kept), "{kept}");
        let bad = RequestTrace::begin(Some(&tp), [0; 16], Some(b"k=v,\xff=x"), &mut e, 1);
        assert_eq!(bad.trace_state(), None);
        let root = t.finish(2).last().unwrap();
        assert!(root.held_bytes() < 2048, "{}", root.held_bytes());
    }

    #[test]
    fn a_pairs_two_attempts_are_open_at_once_and_name_their_own_upstream_parent() {
        let mut e = Entropy::default();
        let mut t = RequestTrace::begin(None, random_trace_id(&mut e), None, &mut e, 1);
        let root = *t.root_id();
        assert_eq!(t.upstream_parent_of(Leg::Decode), &root);
        t.start_pair_attempt(&mut e, 2, vec![("side", "prefill".into())], vec![]);
        let (p, d) = (
            *t.upstream_parent_of(Leg::Prefill),
            *t.upstream_parent_of(Leg::Decode),
        );
        assert!(p != root && d != root && p != d, "each side its own span");
        t.leg_set(Leg::Decode, "http.response.status_code", 500);
        t.end_leg(Leg::Decode, 3, Some("decode failed".into()));
        assert_eq!(t.upstream_parent_of(Leg::Decode), &root);
        assert_eq!(t.upstream_parent_of(Leg::Prefill), &p, "prefill still out");
        // A new pair ends whatever is still open (the prefill side, dropped).
        t.start_pair_attempt(&mut e, 4, vec![], vec![]);
        let spans: Vec<_> = t.finish(9).collect();
        let attempts: Vec<_> = spans.iter().filter(|s| s.name == "attempt").collect();
        assert_eq!(attempts.len(), 4);
        let failed = attempts.iter().find(|s| s.span_id == d).unwrap();
        assert_eq!(
            (failed.end_ns, failed.error.as_deref()),
            (3, Some("decode failed"))
        );
        assert_eq!(
            failed.attrs,
            vec![("http.response.status_code", Value::Int(500))]
        );
        let dropped = attempts.iter().find(|s| s.span_id == p).unwrap();
        assert_eq!((dropped.end_ns, dropped.error.as_deref()), (4, None));
        assert!(attempts
            .iter()
            .all(|s| s.kind == Kind::Client && s.parent_id == root));
        assert_eq!(attempts.iter().filter(|s| s.end_ns == 9).count(), 2);
    }
}
