//! The KV-event wire format of SGLang and vLLM, decoded without I/O and without trust.
//!
//! A publisher sends 3 ZeroMQ frames per message: `topic` (utf-8, often empty), `seq` (8-byte
//! big-endian counter per publisher, +1 per batch) and `payload`, a msgpack `EventBatch`:
//! `[ts, events, dp_rank?]` (the 2-element form of older builds too, and a map form with named
//! fields). Each event is either array-encoded with its class name first
//! (`["BlockStored", hashes, parent, token_ids, block_size, lora_id?, medium?, ...]`,
//! `["BlockRemoved", hashes, medium?, ...]`, `["AllBlocksCleared", ...]`) or map-encoded with a
//! `"type"` key (newer SGLang, vLLM). Engine block hashes arrive as signed or unsigned integers or
//! as bytes; all become one 64-bit [`EngineHash`] (only an id: the index keys blocks by its own
//! hash of the token ids). Unknown fields and unknown event types are skipped. vLLM's
//! `group_idx` (one cache per KV-cache group, the same hashes in each) is read so that a block
//! leaves only with its last group ([`Groups`]).
//!
//! Why hand-written on `rmp`'s marker table and typed reads instead of `rmp-serde` or `rmpv`:
//! the decoder must accept two encodings of every event and several hash types, skip what it
//! does not know, and refuse oversized input *before* allocating for it. A serde derive cannot
//! accept array and map forms plus int/bytes hashes without a hand-written visitor anyway, and
//! `rmpv` first builds a whole `Value` tree (one allocation per element of a 1M-token list)
//! before any cap could apply. Here every length is checked against the caps below and against
//! the bytes left before anything is allocated, and skipping an unknown value walks it
//! iteratively (no recursion, so nesting depth cannot overflow the stack; every element costs
//! at least one input byte, so a skip is linear in the payload).
//!
//! Damage is classified, not just counted: a `BlockStored` that cannot be read, or an event of an
//! unknown type, only makes the index know *less* (safe to skip); a `BlockRemoved` that cannot be
//! read, or an event whose type cannot be told, may hide a removal, so the batch is marked
//! [`Skipped::lossy`] and the intake resets that worker rather than trust stale blocks.

use rmp::Marker;

/// Largest payload frame decoded (bytes). A 1M-token `BlockStored` at page size 1 is about
/// 14 MiB (9-byte hashes + 5-byte token ids); anything above 32 MiB is refused unread: the
/// intake's ZMTP reader closes a connection whose frame header announces more, before the
/// frame's bytes are read.
pub const MAX_PAYLOAD_BYTES: usize = 32 << 20;
/// Most events in one batch; SGLang emits one batch per scheduler step, far below this.
pub const MAX_EVENTS_PER_BATCH: usize = 65_536;
/// Most block hashes in one event (a 1M-token context at page size 1).
pub const MAX_HASHES_PER_EVENT: usize = 1 << 20;
/// Most token ids in one `BlockStored`.
pub const MAX_TOKENS_PER_EVENT: usize = 1 << 20;
/// Longest byte-string block hash accepted (vLLM's are 32-byte SHA-256 digests).
pub const MAX_HASH_BYTES: usize = 64;
/// Longest `medium` string kept ("GPU", "CPU_PINNED", tier names).
pub const MAX_MEDIUM_BYTES: usize = 32;
/// Longest `cache_salt` / `lora_name` accepted (a longer one makes the store unreadable, so the
/// index knows less; it never files blocks under a truncated namespace).
pub const MAX_NAMESPACE_BYTES: usize = 4096;
/// The sequence number a replay server sends after its last buffered batch.
pub const SEQ_END: i64 = -1;

/// A block hash as the engine reported it, reduced to 64 bits. Used only to find a block again
/// (removals, parents): integers keep their 64 bits (a negative i64 is its two's complement), byte
/// strings of up to 8 bytes are read big-endian, longer ones are folded with FNV-1a-64 (a
/// collision, about 2^-64 per pair, could only misdirect one removal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// The id of a byte-string hash (see the type's doc for the rule).
    pub fn from_bytes(b: &[u8]) -> EngineHash {
        if b.len() <= 8 {
            let mut v = 0u64;
            for &x in b {
                v = (v << 8) | u64::from(x);
            }
            return EngineHash(v);
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &x in b {
            h ^= u64::from(x);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        EngineHash(h)
    }
}

/// Blocks the engine now holds: consecutive blocks of one sequence, the first child of `parent`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// One engine hash per block, in sequence order.
    pub block_hashes: Vec<EngineHash>,
    /// The block before the first one (`None`: the sequence starts at the root).
    pub parent: Option<EngineHash>,
    /// The token ids of all these blocks, in order (the index hashes them itself).
    pub token_ids: Vec<u32>,
    /// Tokens per block (the engine's page size).
    pub block_size: u32,
    /// LoRA adapter id, when the blocks belong to one (vLLM; SGLang sends `lora_name`).
    pub lora_id: Option<i64>,
    /// Storage tier ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"); `None` means the device cache.
    pub medium: Option<Box<str>>,
    /// The salt of the request that stored the blocks: the server reuses them only for
    /// requests with the same salt. SGLang 0.5.23 sends it as a field; vLLM only inside the
    /// first block's `extra_keys` (see `ExtraKeys`), read into this field when no
    /// `cache_salt` field came.
    pub cache_salt: Option<Box<str>>,
    /// The LoRA adapter's public name (SGLang 0.5.23, vLLM): blocks of an adapter are reused
    /// only by requests for that adapter.
    pub lora_name: Option<Box<str>>,
}

impl BlockStored {
    /// The storage tier the blocks were stored in.
    pub fn tier(&self) -> Tier {
        Tier::of(self.medium.as_deref())
    }
}

/// Blocks the engine evicted.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier they left (`None`: the device cache).
    pub medium: Option<Box<str>>,
}

impl BlockRemoved {
    /// The storage tier the blocks left (only that copy is gone).
    pub fn tier(&self) -> Tier {
        Tier::of(self.medium.as_deref())
    }
}

/// Where a copy of a block lives on its server. SGLang's hierarchical cache (HiCache) keeps a
/// block on the GPU and/or in host memory and beyond; each store and removal concerns one tier,
/// so a block leaves a server only when its last copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory (`GPU`, or no `medium`): a hit costs nothing.
    Device,
    /// Host memory (`CPU_PINNED`, `CPU`): a hit is loaded back, cheaper than recomputing.
    Host,
    /// Disk, a shared/external pool, or a tier this decoder does not know (`DISK`, `EXTERNAL`):
    /// tracked so its removals touch nothing else, not scored.
    Storage,
}

impl Tier {
    /// Every tier, in the order of their bits.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Storage];

    /// The tier a `medium` string names.
    pub fn of(medium: Option<&str>) -> Tier {
        match medium {
            None | Some("GPU") => Tier::Device,
            Some("CPU_PINNED" | "CPU") => Tier::Host,
            Some(_) => Tier::Storage,
        }
    }

    /// This tier's bit in a tier mask.
    pub fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// One cache change reported by an engine.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were stored (prefill or decode filled pages).
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was flushed (`/flush_cache`, weight update): forget everything.
    AllBlocksCleared,
}

/// Events the decoder skipped inside an otherwise readable batch, by how much they matter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Events of a type this decoder does not know (newer engines): ignored by design.
    pub unknown_type: u32,
    /// `BlockStored` events that were malformed or over a cap: the index just knows less.
    pub stored: u32,
    /// `BlockRemoved` events that were malformed or over a cap, and events whose type could not
    /// be told: a removal may be missing, so the worker's state can no longer be trusted.
    pub lossy: u32,
    /// Stores and removals of one KV-cache group (vLLM's `group_idx`) about blocks another
    /// group of the same server holds (see [`Groups`]): a store that adds nothing, or a
    /// removal that would drop a block the server still holds. Counted per event, whole or
    /// thinned.
    pub other_group: u32,
}

impl Skipped {
    /// Every skipped event.
    pub fn total(&self) -> u32 {
        self.unknown_type + self.stored + self.lossy + self.other_group
    }
}

/// Most blocks [`Groups`] keeps per publisher (about 30 bytes each: 32 MiB at most, and only
/// for a server with several groups); past it new blocks are not tracked, and their removals
/// are applied as they come (as if the server had one group: the index under-estimates).
pub const MAX_GROUPED_BLOCKS: usize = 1 << 20;

/// Which of a server's KV-cache groups hold each block, so that a block leaves the index only
/// when its last group lets it go.
///
/// vLLM 0.33 keeps one cache per KV-cache group: a hybrid model (Gemma-3, gpt-oss: full and
/// sliding-window attention) has several, each storing the same block hashes. Its events say
/// `group_idx` on every store and removal (`BlockPool.cache_full_blocks`,
/// `_emit_block_removed_events`), but the hash is the same in every group, so without this a
/// sliding-window group evicting a block (they leave first: they slide out of the window)
/// would drop it while the full-attention group still holds the prefix. No group can simply
/// be preferred: the event names no kind (`kv_cache_spec_kind` is declared, never set), and
/// group 0 is whatever kind the model's first layer has (sliding window for Gemma-3 and
/// gpt-oss, see `_get_kv_cache_groups_uniform_page_size`). So a block counts as held while any
/// group holds it: stores of a group that add nothing are dropped, and a removal is applied
/// only by the last group holding the block.
///
/// Tracking starts with the first batch that names a group above 0 (a server with one group
/// costs nothing); SGLang sends no `group_idx` and is never touched. State is per publisher and
/// is cleared with it (a reset, `AllBlocksCleared`).
#[derive(Debug, Clone, Default)]
pub struct Groups {
    /// Per (engine hash, tier bit): a bit per group holding it (groups past 63 share bit 63).
    held: std::collections::HashMap<(u64, u8), u64>,
    /// A group above 0 was seen: the server has several.
    multi: bool,
}

impl Groups {
    /// Forget every block (the publisher was reset or its cache cleared).
    pub fn clear(&mut self) {
        self.held.clear();
    }

    fn bit(group: u32) -> u64 {
        1 << group.min(63)
    }

    /// `e` from `group` (`None`: the event names none) as the index should see it: `None` when
    /// nothing of it is left.
    fn admit(&mut self, e: KvEvent, group: Option<u32>, skipped: &mut Skipped) -> Option<KvEvent> {
        let (Some(g), true) = (group, self.multi) else {
            if matches!(e, KvEvent::AllBlocksCleared) {
                self.held.clear();
            }
            return Some(e);
        };
        let bit = Groups::bit(g);
        match e {
            KvEvent::BlockStored(s) => {
                let tier = s.tier().bit();
                let mut new = false;
                for h in &s.block_hashes {
                    match self.held.get_mut(&(h.0, tier)) {
                        // Held by a group already: the index has it.
                        Some(mask) => *mask |= bit,
                        None => {
                            new = true;
                            if self.held.len() < MAX_GROUPED_BLOCKS {
                                self.held.insert((h.0, tier), bit);
                            }
                        }
                    }
                }
                if new {
                    Some(KvEvent::BlockStored(s))
                } else {
                    skipped.other_group += 1;
                    None
                }
            }
            KvEvent::BlockRemoved(mut r) => {
                let tier = r.tier().bit();
                let before = r.block_hashes.len();
                r.block_hashes.retain(|h| {
                    let Some(mask) = self.held.get_mut(&(h.0, tier)) else {
                        return true; // Not tracked: applied as it comes.
                    };
                    *mask &= !bit;
                    if *mask == 0 {
                        self.held.remove(&(h.0, tier));
                        true
                    } else {
                        false
                    }
                });
                if r.block_hashes.len() < before {
                    skipped.other_group += 1;
                }
                (!r.block_hashes.is_empty()).then_some(KvEvent::BlockRemoved(r))
            }
            KvEvent::AllBlocksCleared => {
                self.held.clear();
                Some(KvEvent::AllBlocksCleared)
            }
        }
    }
}

/// One decoded `EventBatch`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// The publisher's timestamp (seconds since the epoch), when it sent a number.
    pub ts: Option<f64>,
    /// The events that could be read, in order.
    pub events: Vec<KvEvent>,
    /// The attention-DP rank the batch says it came from (`attn_dp_rank` / `data_parallel_rank`).
    pub dp_rank: Option<u32>,
    /// What was skipped.
    pub skipped: Skipped,
}

/// Why a message or payload was refused as a whole (the intake counts it as malformed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// A live message must have 3 frames (topic, seq, payload); a replay reply 2 to 4.
    Frames(usize),
    /// The sequence frame must be exactly 8 bytes.
    SeqLength(usize),
    /// A size over one of the caps above.
    TooLarge {
        /// Which cap.
        what: &'static str,
        /// The size claimed.
        len: usize,
    },
    /// The payload ends inside a value, or a length claims more bytes than are left.
    Truncated,
    /// Not msgpack (the reserved 0xc1 byte), or not shaped like an `EventBatch`.
    Invalid(&'static str),
    /// Bytes after the batch.
    TrailingBytes(usize),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Frames(n) => write!(f, "{n} frames"),
            WireError::SeqLength(n) => write!(f, "sequence frame of {n} bytes (want 8)"),
            WireError::TooLarge { what, len } => write!(f, "{what}: {len} over the cap"),
            WireError::Truncated => f.write_str("truncated msgpack"),
            WireError::Invalid(why) => write!(f, "invalid: {why}"),
            WireError::TrailingBytes(n) => write!(f, "{n} bytes after the batch"),
        }
    }
}

impl std::error::Error for WireError {}

/// A live message split into its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// The publisher's topic (ignored by the intake: it subscribes to everything).
    pub topic: &'a [u8],
    /// The batch's sequence number.
    pub seq: i64,
    /// The msgpack `EventBatch`, not yet decoded.
    pub payload: &'a [u8],
}

/// Split a live PUB message: exactly `[topic, seq, payload]`.
pub fn split_live<'a>(frames: &[&'a [u8]]) -> Result<LiveMessage<'a>, WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    Ok(LiveMessage {
        topic,
        seq: parse_seq(seq)?,
        payload,
    })
}

/// One reply of a replay server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch {
        /// Its sequence number.
        seq: i64,
        /// Its msgpack `EventBatch`.
        payload: &'a [u8],
    },
    /// No more batches ([`SEQ_END`]).
    End,
}

/// Split a replay reply as a DEALER sees it, by its frame count:
/// - 4 frames, SGLang 0.5.23: `[b"", topic, seq, payload]` (a live message's frames after the
///   delimiter), ending with `[b"", b"", -1, b""]`;
/// - 3 frames, older SGLang and vLLM: `[b"", seq, payload]`, ending with `[b"", -1, b""]`;
/// - 2 frames: the older form after a REQ socket removed the delimiter.
pub fn split_replay<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, WireError> {
    let (seq, payload) = match frames {
        [[], _topic, seq, payload] => (seq, payload),
        [[], seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return Err(WireError::Frames(frames.len())),
    };
    match parse_seq(seq)? {
        SEQ_END => Ok(ReplayReply::End),
        seq => Ok(ReplayReply::Batch { seq, payload }),
    }
}

/// The frames a DEALER sends to ask a replay server for every batch from `start` on.
pub fn replay_request(start: i64) -> [[u8; 8]; 1] {
    [start.to_be_bytes()]
}

/// An 8-byte big-endian sequence number (signed: the replay end marker is -1).
pub fn parse_seq(frame: &[u8]) -> Result<i64, WireError> {
    let b: [u8; 8] = frame
        .try_into()
        .map_err(|_| WireError::SeqLength(frame.len()))?;
    Ok(i64::from_be_bytes(b))
}

/// Decode one msgpack `EventBatch` (array or map form); see the module doc for what is skipped.
/// KV-cache groups are told apart within this batch only (see [`decode_batch_in`]).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    decode_batch_in(payload, &mut Groups::default())
}

/// [`decode_batch`] for a publisher whose KV-cache groups `groups` has followed so far.
pub fn decode_batch_in(payload: &[u8], groups: &mut Groups) -> Result<EventBatch, WireError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(WireError::TooLarge {
            what: "payload bytes",
            len: payload.len(),
        });
    }
    let mut r = Reader {
        buf: payload,
        last: Marker::Null,
        groups_of: Vec::new(),
    };
    let mut batch = EventBatch::default();
    match r.marker()? {
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = r.container_len(r.last)?;
            if n < 2 {
                return Err(WireError::Invalid("a batch array needs ts and events"));
            }
            batch.ts = r.tolerant(Reader::number)?;
            r.events(&mut batch)?;
            if n >= 3 {
                batch.dp_rank = r.tolerant(Reader::opt_u32)?.flatten();
            }
            r.skip_n(n.saturating_sub(3))?;
        }
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let n = r.container_len(r.last)?;
            let mut saw_events = false;
            for _ in 0..n {
                let Some(key) = r.tolerant(Reader::str_bytes)? else {
                    r.skip()?;
                    continue;
                };
                match key {
                    b"ts" => batch.ts = r.tolerant(Reader::number)?,
                    b"events" => {
                        batch.events.clear();
                        r.groups_of.clear();
                        r.events(&mut batch)?;
                        saw_events = true;
                    }
                    b"attn_dp_rank" | b"data_parallel_rank" | b"dp_rank" => {
                        batch.dp_rank = r.tolerant(Reader::opt_u32)?.flatten()
                    }
                    _ => r.skip()?,
                }
            }
            if !saw_events {
                return Err(WireError::Invalid("a batch map needs `events`"));
            }
        }
        _ => return Err(WireError::Invalid("a batch is an array or a map")),
    }
    if !r.buf.is_empty() {
        return Err(WireError::TrailingBytes(r.buf.len()));
    }
    // A batch naming a group above 0 comes from a server with several: from it on (its own
    // earlier events included, as group 0 stores before group 1 in one step) blocks are
    // tracked per group.
    groups.multi |= r.groups_of.iter().any(|g| g.is_some_and(|g| g > 0));
    if groups.multi {
        let events = std::mem::take(&mut batch.events);
        let mut skipped = batch.skipped;
        batch.events = events
            .into_iter()
            .zip(r.groups_of)
            .filter_map(|(e, g)| groups.admit(e, g, &mut skipped))
            .collect();
        batch.skipped = skipped;
    } else if batch.events.contains(&KvEvent::AllBlocksCleared) {
        groups.clear();
    }
    Ok(batch)
}

/// Which event a tag names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Tag {
    fn of(name: &[u8]) -> Tag {
        match name {
            b"BlockStored" => Tag::Stored,
            b"BlockRemoved" => Tag::Removed,
            b"AllBlocksCleared" => Tag::Cleared,
            _ => Tag::Unknown,
        }
    }
}

/// The fields of one event as they were found (either encoding).
#[derive(Default)]
struct Fields {
    tag: Option<Tag>,
    hashes: Option<Vec<EngineHash>>,
    parent: Option<Option<EngineHash>>,
    tokens: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Box<str>>,
    cache_salt: Option<Box<str>>,
    lora_name: Option<Box<str>>,
    /// vLLM's `extra_keys`, as far as the namespace needs them.
    extra: ExtraKeys,
    /// `extra_keys` could not be read: a store is then unreadable (it may be salted); an event
    /// of another type has no such field and is not spoiled by it.
    extra_bad: bool,
    /// vLLM's `group_idx`: the KV-cache group that stored or evicted the blocks (`None`: not
    /// said, or not a u32; SGLang sends none).
    group: Option<u32>,
    /// A known field could not be read.
    bad: bool,
}

/// The bare strings of the first block's entry of vLLM's `extra_keys` (the first two; nothing
/// else there names a namespace). vLLM publishes one entry per block (`null` or a list) with,
/// in order: the adapter's name when `lora_name` is set, `[mm_identifier, offset]` pairs (lists),
/// the request's `cache_salt` (a string, on the request's first block only: its later blocks
/// carry it through the parent hash they chain from) and prompt-embedding digests (bytes). So of
/// the first block's strings, the first is the adapter's when the event names one, and the
/// next one is the salt.
#[derive(Default, Debug, Clone, PartialEq)]
struct ExtraKeys {
    strings: [Option<Box<str>>; 2],
}

impl ExtraKeys {
    /// The salt these keys carry for blocks of adapter `lora_name` (or of none).
    fn salt(self, lora_name: Option<&str>) -> Option<Box<str>> {
        let [first, second] = self.strings;
        let salt = if lora_name.is_some() { second } else { first };
        salt.filter(|s| !s.is_empty())
    }
}

impl Fields {
    /// The event, or the tag of an event that had to be skipped (`None`: its type is unknown to
    /// the wire, which is not the same as an unknown type name).
    fn finish(self) -> Result<Option<KvEvent>, Option<Tag>> {
        let tag = self.tag;
        if self.bad || (self.extra_bad && tag == Some(Tag::Stored)) {
            return Err(tag);
        }
        match tag {
            Some(Tag::Stored) => match (self.hashes, self.parent, self.tokens, self.block_size) {
                (Some(block_hashes), parent, Some(token_ids), Some(block_size)) => {
                    Ok(Some(KvEvent::BlockStored(BlockStored {
                        block_hashes,
                        parent: parent.flatten(),
                        token_ids,
                        block_size,
                        lora_id: self.lora_id,
                        medium: self.medium,
                        cache_salt: self
                            .cache_salt
                            .or_else(|| self.extra.salt(self.lora_name.as_deref())),
                        lora_name: self.lora_name,
                    })))
                }
                _ => Err(tag),
            },
            Some(Tag::Removed) => match self.hashes {
                Some(block_hashes) => Ok(Some(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes,
                    medium: self.medium,
                }))),
                None => Err(tag),
            },
            Some(Tag::Cleared) => Ok(Some(KvEvent::AllBlocksCleared)),
            Some(Tag::Unknown) => Ok(None),
            None => Err(None),
        }
    }
}

/// A cursor over msgpack bytes: `rmp` reads markers and big-endian numbers, this adds the caps,
/// zero-copy strings and the iterative skip.
struct Reader<'a> {
    buf: &'a [u8],
    /// The marker most recently read (for `container_len`).
    last: Marker,
    /// The KV-cache group (`group_idx`) of each event read into the batch, in order.
    groups_of: Vec<Option<u32>>,
}

type Res<T> = Result<T, WireError>;

impl<'a> Reader<'a> {
    fn marker(&mut self) -> Res<Marker> {
        let m = rmp::decode::read_marker(&mut self.buf).map_err(|_| WireError::Truncated)?;
        self.last = m;
        Ok(m)
    }

    fn peek(&self) -> Option<Marker> {
        self.buf.first().map(|&b| Marker::from_u8(b))
    }

    fn take(&mut self, n: usize) -> Res<&'a [u8]> {
        if n > self.buf.len() {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn be<const N: usize>(&mut self) -> Res<[u8; N]> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }

    /// The element (array) or entry (map) count after a container marker, checked against the
    /// bytes left (every element takes at least one byte) so no claim outgrows the input.
    fn container_len(&mut self, m: Marker) -> Res<usize> {
        let (n, per) = match m {
            Marker::FixArray(n) => (usize::from(n), 1),
            Marker::Array16 => (usize::from(u16::from_be_bytes(self.be()?)), 1),
            Marker::Array32 => (u32::from_be_bytes(self.be()?) as usize, 1),
            Marker::FixMap(n) => (usize::from(n), 2),
            Marker::Map16 => (usize::from(u16::from_be_bytes(self.be()?)), 2),
            Marker::Map32 => (u32::from_be_bytes(self.be()?) as usize, 2),
            _ => return Err(WireError::Invalid("not a container")),
        };
        if n.saturating_mul(per) > self.buf.len() {
            return Err(WireError::Truncated);
        }
        Ok(n)
    }

    fn array_len(&mut self, cap: usize, what: &'static str) -> Res<usize> {
        let m = self.marker()?;
        if !matches!(m, Marker::FixArray(_) | Marker::Array16 | Marker::Array32) {
            return Err(WireError::Invalid("expected an array"));
        }
        let n = self.container_len(m)?;
        if n > cap {
            return Err(WireError::TooLarge { what, len: n });
        }
        Ok(n)
    }

    /// Length of a str/bin/ext payload after its marker (`None`: not such a marker).
    fn blob_len(&mut self, m: Marker) -> Res<Option<usize>> {
        Ok(Some(match m {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(self.be::<1>()?[0]),
            Marker::Str16 | Marker::Bin16 => usize::from(u16::from_be_bytes(self.be()?)),
            Marker::Str32 | Marker::Bin32 => u32::from_be_bytes(self.be()?) as usize,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(self.be::<1>()?[0]) + 1,
            Marker::Ext16 => usize::from(u16::from_be_bytes(self.be()?)) + 1,
            Marker::Ext32 => u32::from_be_bytes(self.be()?) as usize + 1,
            _ => return Ok(None),
        }))
    }

    /// A str or bin value's bytes, borrowed.
    fn str_bytes(&mut self) -> Res<&'a [u8]> {
        let m = self.marker()?;
        if !matches!(
            m,
            Marker::FixStr(_)
                | Marker::Str8
                | Marker::Str16
                | Marker::Str32
                | Marker::Bin8
                | Marker::Bin16
                | Marker::Bin32
        ) {
            return Err(WireError::Invalid("expected a string"));
        }
        let n = self.blob_len(m)?.unwrap_or(0);
        self.take(n)
    }

    /// Any msgpack integer, widened (u64 and i64 both fit in i128).
    fn int(&mut self) -> Res<i128> {
        Ok(match self.marker()? {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be::<1>()?[0]),
            Marker::U16 => i128::from(u16::from_be_bytes(self.be()?)),
            Marker::U32 => i128::from(u32::from_be_bytes(self.be()?)),
            Marker::U64 => i128::from(u64::from_be_bytes(self.be()?)),
            Marker::I8 => i128::from(i8::from_be_bytes(self.be()?)),
            Marker::I16 => i128::from(i16::from_be_bytes(self.be()?)),
            Marker::I32 => i128::from(i32::from_be_bytes(self.be()?)),
            Marker::I64 => i128::from(i64::from_be_bytes(self.be()?)),
            _ => return Err(WireError::Invalid("expected an integer")),
        })
    }

    fn is_nil(&mut self) -> Res<bool> {
        if self.peek() == Some(Marker::Null) {
            self.marker()?;
            return Ok(true);
        }
        Ok(false)
    }

    /// A float or an integer.
    fn number(&mut self) -> Res<f64> {
        match self.peek() {
            Some(Marker::F64) => {
                self.marker()?;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Some(Marker::F32) => {
                self.marker()?;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            _ => Ok(self.int()? as f64),
        }
    }

    fn opt_u32(&mut self) -> Res<Option<u32>> {
        if self.is_nil()? {
            return Ok(None);
        }
        u32::try_from(self.int()?)
            .map(Some)
            .map_err(|_| WireError::Invalid("expected a u32"))
    }

    fn hash(&mut self) -> Res<EngineHash> {
        match self.peek() {
            Some(
                Marker::FixStr(_)
                | Marker::Str8
                | Marker::Str16
                | Marker::Str32
                | Marker::Bin8
                | Marker::Bin16
                | Marker::Bin32,
            ) => {
                let b = self.str_bytes()?;
                if b.len() > MAX_HASH_BYTES {
                    return Err(WireError::TooLarge {
                        what: "hash bytes",
                        len: b.len(),
                    });
                }
                Ok(EngineHash::from_bytes(b))
            }
            _ => {
                let v = self.int()?;
                if v < i128::from(i64::MIN) || v > i128::from(u64::MAX) {
                    return Err(WireError::Invalid("hash out of range"));
                }
                // Truncating keeps a negative i64's two's-complement bits.
                Ok(EngineHash(v as u64))
            }
        }
    }

    fn opt_hash(&mut self) -> Res<Option<EngineHash>> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hashes(&mut self) -> Res<Vec<EngineHash>> {
        let n = self.array_len(MAX_HASHES_PER_EVENT, "hashes per event")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Res<Vec<u32>> {
        let n = self.array_len(MAX_TOKENS_PER_EVENT, "token ids per event")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(u32::try_from(self.int()?).map_err(|_| WireError::Invalid("token id"))?);
        }
        Ok(out)
    }

    fn block_size(&mut self) -> Res<u32> {
        match u32::try_from(self.int()?) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(WireError::Invalid("block size")),
        }
    }

    /// An optional integer that may be anything else (then `None`; it is informational).
    fn opt_i64(&mut self) -> Res<Option<i64>> {
        Ok(self
            .tolerant(Reader::int)?
            .and_then(|v| i64::try_from(v).ok()))
    }

    fn medium(&mut self) -> Res<Option<Box<str>>> {
        if self.is_nil()? {
            return Ok(None);
        }
        let b = self.str_bytes()?;
        if b.len() > MAX_MEDIUM_BYTES {
            return Err(WireError::TooLarge {
                what: "medium bytes",
                len: b.len(),
            });
        }
        std::str::from_utf8(b)
            .map(|s| Some(s.into()))
            .map_err(|_| WireError::Invalid("medium is not utf-8"))
    }

    /// An optional namespace string (`cache_salt`, `lora_name`), capped.
    fn namespace(&mut self) -> Res<Option<Box<str>>> {
        if self.is_nil()? {
            return Ok(None);
        }
        let b = self.str_bytes()?;
        if b.len() > MAX_NAMESPACE_BYTES {
            return Err(WireError::TooLarge {
                what: "namespace bytes",
                len: b.len(),
            });
        }
        std::str::from_utf8(b)
            .map(|s| Some(s.into()))
            .map_err(|_| WireError::Invalid("namespace is not utf-8"))
    }

    /// vLLM's `extra_keys`: `null`, or one entry per block, each `null` or a list. Only the
    /// first block's bare strings are kept (the first two, each capped as a namespace string);
    /// everything else is skipped. Another shape, or a string past the cap, is an error: the
    /// store is then dropped rather than filed in the default namespace when it may be salted.
    fn extra_keys(&mut self) -> Res<ExtraKeys> {
        let mut keys = ExtraKeys::default();
        if self.is_nil()? {
            return Ok(keys);
        }
        let blocks = self.array_len(MAX_HASHES_PER_EVENT, "extra_keys entries")?;
        if blocks == 0 {
            return Ok(keys);
        }
        if !self.is_nil()? {
            let items = self.array_len(MAX_TOKENS_PER_EVENT, "extra keys of a block")?;
            let mut found = 0;
            for _ in 0..items {
                let is_str = matches!(
                    self.peek(),
                    Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
                );
                if is_str && found < keys.strings.len() {
                    keys.strings[found] = self.namespace()?;
                    found += 1;
                } else {
                    self.skip()?;
                }
            }
        }
        self.skip_n(blocks - 1)?;
        Ok(keys)
    }

    /// Read one value with `f`; if it has another shape, skip it and return `None`. Only a
    /// truncated or invalid encoding (the skip fails too) is an error.
    fn tolerant<T>(&mut self, f: impl FnOnce(&mut Self) -> Res<T>) -> Res<Option<T>> {
        let start = self.buf;
        match f(self) {
            Ok(v) => Ok(Some(v)),
            Err(_) => {
                self.buf = start;
                self.skip()?;
                Ok(None)
            }
        }
    }

    /// Like `tolerant`, but a value that cannot be read marks the event bad.
    fn field<T>(&mut self, bad: &mut bool, f: impl FnOnce(&mut Self) -> Res<T>) -> Res<Option<T>> {
        let v = self.tolerant(f)?;
        *bad |= v.is_none();
        Ok(v)
    }

    /// Skip one whole value of any shape, iteratively.
    fn skip(&mut self) -> Res<()> {
        self.skip_n(1)
    }

    fn skip_n(&mut self, n: usize) -> Res<()> {
        let mut pending = n;
        while pending > 0 {
            pending -= 1;
            let m = self.marker()?;
            match m {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => {}
                Marker::U8 | Marker::I8 => drop(self.take(1)?),
                Marker::U16 | Marker::I16 => drop(self.take(2)?),
                Marker::U32 | Marker::I32 | Marker::F32 => drop(self.take(4)?),
                Marker::U64 | Marker::I64 | Marker::F64 => drop(self.take(8)?),
                Marker::FixArray(_)
                | Marker::Array16
                | Marker::Array32
                | Marker::FixMap(_)
                | Marker::Map16
                | Marker::Map32 => {
                    let per = if matches!(m, Marker::FixMap(_) | Marker::Map16 | Marker::Map32) {
                        2
                    } else {
                        1
                    };
                    pending = pending.saturating_add(self.container_len(m)? * per);
                }
                Marker::Reserved => return Err(WireError::Invalid("reserved byte 0xc1")),
                other => {
                    let n = self.blob_len(other)?.unwrap_or(0);
                    self.take(n)?;
                }
            }
        }
        Ok(())
    }

    /// The `events` array into `batch`, each event decoded or classified as skipped.
    fn events(&mut self, batch: &mut EventBatch) -> Res<()> {
        let n = self.array_len(MAX_EVENTS_PER_BATCH, "events per batch")?;
        batch.events.reserve(n);
        for _ in 0..n {
            let fields = match self.peek() {
                Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
                    self.array_event()?
                }
                Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => self.map_event()?,
                _ => {
                    self.skip()?;
                    Fields::default()
                }
            };
            let group = fields.group;
            match fields.finish() {
                Ok(Some(e)) => {
                    batch.events.push(e);
                    self.groups_of.push(group);
                }
                Ok(None) => batch.skipped.unknown_type += 1,
                Err(Some(Tag::Stored)) => batch.skipped.stored += 1,
                Err(_) => batch.skipped.lossy += 1,
            }
        }
        Ok(())
    }

    /// `["Tag", field, field, ...]`: fields by position, extra trailing ones skipped.
    fn array_event(&mut self) -> Res<Fields> {
        let m = self.marker()?;
        let n = self.container_len(m)?;
        let mut f = Fields::default();
        if n == 0 {
            return Ok(f);
        }
        let Some(tag) = self.tolerant(Reader::str_bytes)? else {
            self.skip_n(n - 1)?;
            return Ok(f);
        };
        let tag = Tag::of(tag);
        f.tag = Some(tag);
        // Fields not yet read; an event may stop early (trailing optional fields omitted).
        let mut left = n - 1;
        let mut next = |_: &mut Self| -> bool {
            let more = left > 0;
            left -= usize::from(more);
            more
        };
        let bad = &mut f.bad;
        match tag {
            Tag::Stored => {
                if next(self) {
                    f.hashes = self.field(bad, Reader::hashes)?;
                }
                if next(self) {
                    f.parent = self.field(bad, Reader::opt_hash)?;
                }
                if next(self) {
                    f.tokens = self.field(bad, Reader::tokens)?;
                }
                if next(self) {
                    f.block_size = self.field(bad, Reader::block_size)?;
                }
                if next(self) {
                    f.lora_id = self.opt_i64()?;
                }
                if next(self) {
                    f.medium = self.field(bad, Reader::medium)?.flatten();
                }
                // vLLM's array form goes on with lora_name (then extra_keys, group_idx);
                // SGLang 0.5.23 sends its optional fields (cache_salt, lora_name) in the map
                // form only. Informational here: another shape is ignored, not an error.
                if next(self) {
                    f.lora_name = self.tolerant(Reader::namespace)?.flatten();
                }
                if next(self) {
                    match self.tolerant(Reader::extra_keys)? {
                        Some(keys) => f.extra = keys,
                        None => f.extra_bad = true,
                    }
                }
                if next(self) {
                    f.group = self.tolerant(Reader::opt_u32)?.flatten();
                }
            }
            Tag::Removed => {
                if next(self) {
                    f.hashes = self.field(bad, Reader::hashes)?;
                }
                if next(self) {
                    f.medium = self.field(bad, Reader::medium)?.flatten();
                }
                if next(self) {
                    f.group = self.tolerant(Reader::opt_u32)?.flatten();
                }
            }
            Tag::Cleared | Tag::Unknown => {}
        }
        self.skip_n(left)?;
        Ok(f)
    }

    /// `{"type": "Tag", "block_hashes": [...], ...}`: fields by name in any order.
    fn map_event(&mut self) -> Res<Fields> {
        let m = self.marker()?;
        let n = self.container_len(m)?;
        let mut f = Fields::default();
        for _ in 0..n {
            let Some(key) = self.tolerant(Reader::str_bytes)? else {
                self.skip()?;
                continue;
            };
            let bad = &mut f.bad;
            match key {
                b"type" => f.tag = self.tolerant(Reader::str_bytes)?.map(Tag::of),
                b"block_hashes" => f.hashes = self.field(bad, Reader::hashes)?,
                b"parent_block_hash" => f.parent = self.field(bad, Reader::opt_hash)?,
                b"token_ids" => f.tokens = self.field(bad, Reader::tokens)?,
                b"block_size" => f.block_size = self.field(bad, Reader::block_size)?,
                b"lora_id" => f.lora_id = self.opt_i64()?,
                b"medium" => f.medium = self.field(bad, Reader::medium)?.flatten(),
                b"cache_salt" => f.cache_salt = self.field(bad, Reader::namespace)?.flatten(),
                b"lora_name" => f.lora_name = self.field(bad, Reader::namespace)?.flatten(),
                b"extra_keys" => match self.tolerant(Reader::extra_keys)? {
                    Some(keys) => f.extra = keys,
                    None => f.extra_bad = true,
                },
                b"group_idx" => f.group = self.tolerant(Reader::opt_u32)?.flatten(),
                _ => self.skip()?,
            }
        }
        // A field of another event type that failed to read does not spoil this one.
        if f.tag == Some(Tag::Cleared) || f.tag == Some(Tag::Unknown) {
            f.bad = false;
        }
        Ok(f)
    }
}

/// How [`encode_batch`] lays out a batch and its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `[ts, events, dp_rank]` with array-encoded events (msgspec `array_like`, SGLang 0.5).
    Array,
    /// `[ts, events, dp_rank]` with map-encoded events (newer SGLang, vLLM).
    MapEvents,
    /// A map batch `{"ts", "events", "attn_dp_rank"}` with map-encoded events.
    Map,
    /// vLLM 0.33: `[ts, events, dp_rank]` with map-encoded events that carry no `cache_salt`
    /// field: the salt of a store that starts a sequence goes in its first block's
    /// `extra_keys`, after the adapter's name, which every block's keys start with (a
    /// continuation's salt is not written: vLLM's block hashes carry it through the parent).
    Vllm,
}

/// Encode a batch as an engine would, for round-trip tests and fuzz seeds. Hashes are written as
/// unsigned integers (the simulator has its own publisher, which writes them signed as SGLang
/// does and omits absent map fields).
pub fn encode_batch(batch: &EventBatch, form: Form) -> Vec<u8> {
    let mut e = Encoder(Vec::new());
    if form == Form::Map {
        e.map(3);
        e.str("ts");
        e.f64(batch.ts.unwrap_or(0.0));
        e.str("attn_dp_rank");
        e.opt_uint(batch.dp_rank.map(u64::from));
        e.str("events");
    } else {
        e.array(3);
        e.f64(batch.ts.unwrap_or(0.0));
    }
    e.array(batch.events.len());
    for ev in &batch.events {
        match (form, ev) {
            (Form::Vllm, KvEvent::BlockStored(s)) => e.vllm_stored(s),
            _ => e.event(ev, form != Form::Array),
        }
    }
    if form != Form::Map {
        e.opt_uint(batch.dp_rank.map(u64::from));
    }
    e.0
}

/// msgpack writer over a Vec (writing into memory cannot fail, so results are dropped here once).
struct Encoder(Vec<u8>);

impl Encoder {
    fn array(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(&mut self.0, n as u32);
    }
    fn map(&mut self, n: usize) {
        let _ = rmp::encode::write_map_len(&mut self.0, n as u32);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(&mut self.0, s);
    }
    fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(&mut self.0, v);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(&mut self.0, v);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(&mut self.0);
    }
    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
    fn hashes(&mut self, hs: &[EngineHash]) {
        self.array(hs.len());
        for h in hs {
            self.uint(h.0);
        }
    }
    /// An event's opening: `["Name", ...` or `{"type": "Name", ...` with `fields` more fields.
    fn header(&mut self, map: bool, name: &str, fields: usize) {
        if map {
            self.map(fields + 1);
            self.str("type");
        } else {
            self.array(fields + 1);
        }
        self.str(name);
    }
    fn key(&mut self, map: bool, k: &str) {
        if map {
            self.str(k);
        }
    }
    /// A store as vLLM 0.33 writes it (see [`Form::Vllm`]).
    fn vllm_stored(&mut self, s: &BlockStored) {
        let salt = s.cache_salt.as_deref().filter(|_| s.parent.is_none());
        let lora = s.lora_name.as_deref();
        let keyed = salt.is_some() || lora.is_some();
        self.header(true, "BlockStored", if keyed { 8 } else { 7 });
        self.str("block_hashes");
        self.hashes(&s.block_hashes);
        self.str("parent_block_hash");
        self.opt_uint(s.parent.map(|p| p.0));
        self.str("token_ids");
        self.array(s.token_ids.len());
        for &t in &s.token_ids {
            self.uint(u64::from(t));
        }
        self.str("block_size");
        self.uint(u64::from(s.block_size));
        self.str("lora_id");
        match s.lora_id {
            Some(l) => {
                let _ = rmp::encode::write_sint(&mut self.0, l);
            }
            None => self.nil(),
        }
        self.str("medium");
        self.opt_str(s.medium.as_deref());
        self.str("lora_name");
        self.opt_str(lora);
        if keyed {
            self.str("extra_keys");
            self.array(s.block_hashes.len());
            for i in 0..s.block_hashes.len() {
                let keys: Vec<&str> = lora.into_iter().chain(salt.filter(|_| i == 0)).collect();
                if keys.is_empty() {
                    self.nil();
                } else {
                    self.array(keys.len());
                    for k in keys {
                        self.str(k);
                    }
                }
            }
        }
    }

    fn event(&mut self, ev: &KvEvent, map: bool) {
        match ev {
            KvEvent::BlockStored(s) => {
                self.header(map, "BlockStored", if map { 8 } else { 7 });
                self.key(map, "block_hashes");
                self.hashes(&s.block_hashes);
                self.key(map, "parent_block_hash");
                self.opt_uint(s.parent.map(|p| p.0));
                self.key(map, "token_ids");
                self.array(s.token_ids.len());
                for &t in &s.token_ids {
                    self.uint(u64::from(t));
                }
                self.key(map, "block_size");
                self.uint(u64::from(s.block_size));
                self.key(map, "lora_id");
                match s.lora_id {
                    Some(l) => {
                        let _ = rmp::encode::write_sint(&mut self.0, l);
                    }
                    None => self.nil(),
                }
                self.key(map, "medium");
                self.opt_str(s.medium.as_deref());
                self.key(map, "lora_name");
                self.opt_str(s.lora_name.as_deref());
                if map {
                    self.key(map, "cache_salt");
                    self.opt_str(s.cache_salt.as_deref());
                }
            }
            KvEvent::BlockRemoved(r) => {
                self.header(map, "BlockRemoved", 2);
                self.key(map, "block_hashes");
                self.hashes(&r.block_hashes);
                self.key(map, "medium");
                self.opt_str(r.medium.as_deref());
            }
            KvEvent::AllBlocksCleared => self.header(map, "AllBlocksCleared", 0),
        }
    }
}

#[cfg(test)]
mod tests;
