//! The `EventBatch` payload, pure: the simulated cache's [`CacheEvent`]s as SGLang's msgpack.
//!
//! Map form (the default, SGLang 0.5.23): msgspec tagged structs without `array_like`, so each
//! event is a map with `"type"`; fields without a default are always written (`parent_block_hash`
//! and `lora_id` as nil when absent), optional ones (`cache_salt`, `lora_name`) only when set,
//! and `medium` always, as the recorder always sets it. Like 0.5.23's recorder, consecutive
//! stores that chain (same medium and namespace, each starting where the previous ended) go out
//! as one `BlockStored`, and consecutive removals from one medium as one `BlockRemoved`.
//!
//! Array form (older SGLang and vLLM): `["BlockStored", [hash], parent, token_ids, block_size,
//! lora_id, medium]`, one per page, and `["BlockRemoved", hashes, medium]` per radix node.
//!
//! vLLM form (`--engine vllm`, vLLM 0.33): maps with every field of vLLM's structs that has no
//! default (`lora_name` nil when absent) plus the defaulted ones vLLM sets (`extra_keys`,
//! `group_idx`, `kv_cache_spec_kind`); hashes as unsigned ints; one `BlockRemoved` per block.

use rmp::encode;

use super::EventEncoding;
use crate::sim::radix::CacheEvent;

/// Appends msgpack values to a `Vec<u8>` (writes to a vector cannot fail).
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn array(&mut self, n: usize) {
        let _ = encode::write_array_len(self.0, n as u32);
    }
    fn map(&mut self, n: usize) {
        let _ = encode::write_map_len(self.0, n as u32);
    }
    fn str(&mut self, s: &str) {
        let _ = encode::write_str(self.0, s);
    }
    fn uint(&mut self, n: u64) {
        let _ = encode::write_uint(self.0, n);
    }
    /// Block hashes go out as signed 64-bit integers, as SGLang's do.
    fn hash(&mut self, h: u64) {
        let _ = encode::write_sint(self.0, h as i64);
    }
    /// vLLM's block hashes: the low 64 bits of its digest as an unsigned int
    /// (`maybe_convert_block_hash`), so half of them are above 2^63.
    fn uhash(&mut self, h: u64) {
        let _ = encode::write_uint(self.0, h);
    }
    fn nil(&mut self) {
        let _ = encode::write_nil(self.0);
    }
    fn opt_hash(&mut self, h: Option<u64>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }
    fn hashes<'h>(&mut self, n: usize, hs: impl Iterator<Item = &'h u64>) {
        self.array(n);
        for &h in hs {
            self.hash(h);
        }
    }
    fn tokens<'t>(&mut self, n: usize, ts: impl Iterator<Item = &'t u32>) {
        self.array(n);
        for &t in ts {
            self.uint(u64::from(t));
        }
    }
}

/// Encode one `EventBatch` (`[ts, events, attn_dp_rank]`) into `out` (cleared first) and
/// return the number of wire events in it. `block_size` is the page size.
pub fn encode_batch(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[CacheEvent],
    block_size: usize,
    dp_rank: Option<u32>,
    encoding: EventEncoding,
) -> usize {
    // The events go to a buffer of their own first: the batch's array header needs their
    // count, which coalescing decides.
    let mut body = Vec::with_capacity(64 * events.len());
    let bs = block_size.max(1);
    let n = match encoding {
        EventEncoding::Map => map_events(&mut Writer(&mut body), events, bs),
        EventEncoding::Array => array_events(&mut Writer(&mut body), events, bs),
        EventEncoding::Vllm => vllm_events(&mut Writer(&mut body), events, bs),
    };
    out.clear();
    let mut w = Writer(out);
    w.array(3);
    let _ = encode::write_f64(w.0, ts);
    w.array(n);
    w.0.extend_from_slice(&body);
    match dp_rank {
        Some(r) => w.uint(u64::from(r)),
        None => w.nil(),
    }
    n
}

/// The older array form: one `BlockStored` per page, one `BlockRemoved` per node.
fn array_events(w: &mut Writer<'_>, events: &[CacheEvent], bs: usize) -> usize {
    let mut n = 0;
    for ev in events {
        match ev {
            CacheEvent::Stored {
                hashes,
                parent,
                tokens,
                medium,
                ..
            } => {
                let mut parent = *parent;
                for (h, page) in hashes.iter().zip(tokens.chunks(bs)) {
                    w.array(7);
                    w.str("BlockStored");
                    w.hashes(1, [*h].iter());
                    w.opt_hash(parent);
                    w.tokens(page.len(), page.iter());
                    w.uint(page.len() as u64);
                    w.nil(); // lora_id
                    w.str(medium.as_str());
                    parent = Some(*h);
                    n += 1;
                }
            }
            CacheEvent::Removed { hashes, medium } => {
                w.array(3);
                w.str("BlockRemoved");
                w.hashes(hashes.len(), hashes.iter());
                w.str(medium.as_str());
                n += 1;
            }
            CacheEvent::Cleared => {
                w.array(1);
                w.str("AllBlocksCleared");
                n += 1;
            }
        }
    }
    n
}

/// Whether `next` goes out in the same wire event as `prev` (0.5.23's `enqueue` coalescing):
/// removals from one medium; stores of one medium and namespace where `next` starts at
/// `prev`'s last page.
fn coalesces(prev: &CacheEvent, next: &CacheEvent) -> bool {
    match (prev, next) {
        (CacheEvent::Removed { medium: a, .. }, CacheEvent::Removed { medium: b, .. }) => a == b,
        (
            CacheEvent::Stored {
                hashes,
                medium: m1,
                tags: t1,
                ..
            },
            CacheEvent::Stored {
                parent: Some(p),
                medium: m2,
                tags: t2,
                ..
            },
        ) => m1 == m2 && t1 == t2 && hashes.last() == Some(p),
        _ => false,
    }
}

/// The map form, coalesced; returns the number of wire events.
fn map_events(w: &mut Writer<'_>, events: &[CacheEvent], bs: usize) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < events.len() {
        let mut j = i + 1;
        while j < events.len() && coalesces(&events[j - 1], &events[j]) {
            j += 1;
        }
        map_event(w, &events[i..j], bs);
        n += 1;
        i = j;
    }
    n
}

/// One map event for a run of coalescing events (all `Stored`, all `Removed`, or one
/// `Cleared`).
fn map_event(w: &mut Writer<'_>, run: &[CacheEvent], bs: usize) {
    match &run[0] {
        CacheEvent::Stored {
            parent,
            medium,
            tags,
            ..
        } => {
            let parts = || {
                run.iter().filter_map(|e| match e {
                    CacheEvent::Stored { hashes, tokens, .. } => Some((hashes, tokens)),
                    _ => None,
                })
            };
            let nh: usize = parts().map(|(h, _)| h.len()).sum();
            let nt: usize = parts().map(|(_, t)| t.len()).sum();
            let salt = tags.as_ref().and_then(|t| t.cache_salt.as_deref());
            let lora = tags.as_ref().and_then(|t| t.lora_name.as_deref());
            w.map(7 + usize::from(salt.is_some()) + usize::from(lora.is_some()));
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            w.hashes(nh, parts().flat_map(|(h, _)| h.iter()));
            w.str("parent_block_hash");
            w.opt_hash(*parent);
            w.str("token_ids");
            w.tokens(nt, parts().flat_map(|(_, t)| t.iter()));
            // One page's tokens, as SGLang's `len(page_tokens)`: the simulator stores whole
            // pages only.
            w.str("block_size");
            w.uint(bs as u64);
            w.str("lora_id");
            w.nil();
            w.str("medium");
            w.str(medium.as_str());
            if let Some(s) = salt {
                w.str("cache_salt");
                w.str(s);
            }
            if let Some(l) = lora {
                w.str("lora_name");
                w.str(l);
            }
        }
        CacheEvent::Removed { medium, .. } => {
            let hashes = || {
                run.iter().flat_map(|e| match e {
                    CacheEvent::Removed { hashes, .. } => hashes.as_slice(),
                    _ => &[],
                })
            };
            w.map(3);
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            w.hashes(hashes().count(), hashes());
            w.str("medium");
            w.str(medium.as_str());
        }
        CacheEvent::Cleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
    }
}

/// vLLM 0.33's events (`vllm/distributed/kv_events.py`, msgspec tagged structs with
/// `omit_defaults`, so fields without a default are always written and defaulted ones only when
/// set). A chained run of stores is one `BlockStored`, as vLLM's block pool reports a request's
/// newly full blocks in one event per step; each removal is its own `BlockRemoved` of one hash,
/// as the pool evicts block by block. Returns the number of wire events.
fn vllm_events(w: &mut Writer<'_>, events: &[CacheEvent], bs: usize) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < events.len() {
        let mut j = i + 1;
        if matches!(events[i], CacheEvent::Stored { .. }) {
            while j < events.len() && coalesces(&events[j - 1], &events[j]) {
                j += 1;
            }
        }
        n += vllm_event(w, &events[i..j], bs);
        i = j;
    }
    n
}

/// vLLM's name for a tier: the host tier is its CPU offload medium.
fn vllm_medium(m: crate::sim::radix::Medium) -> &'static str {
    match m {
        crate::sim::radix::Medium::Gpu => "GPU",
        crate::sim::radix::Medium::CpuPinned => "CPU",
    }
}

/// One run (a chain of `Stored`, one `Removed`, or one `Cleared`) as vLLM's events; returns how
/// many were written.
fn vllm_event(w: &mut Writer<'_>, run: &[CacheEvent], bs: usize) -> usize {
    match &run[0] {
        CacheEvent::Stored {
            parent,
            medium,
            tags,
            ..
        } => {
            let parts = || {
                run.iter().filter_map(|e| match e {
                    CacheEvent::Stored { hashes, tokens, .. } => Some((hashes, tokens)),
                    _ => None,
                })
            };
            let nh: usize = parts().map(|(h, _)| h.len()).sum();
            let nt: usize = parts().map(|(_, t)| t.len()).sum();
            let salt = tags.as_ref().and_then(|t| t.cache_salt.as_deref());
            let lora = tags.as_ref().and_then(|t| t.lora_name.as_deref());
            w.map(11);
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            w.array(nh);
            for &h in parts().flat_map(|(h, _)| h.iter()) {
                w.uhash(h);
            }
            w.str("parent_block_hash");
            match parent {
                Some(p) => w.uhash(*p),
                None => w.nil(),
            }
            w.str("token_ids");
            w.tokens(nt, parts().flat_map(|(_, t)| t.iter()));
            w.str("block_size");
            w.uint(bs as u64);
            // Deprecated in vLLM in favour of `lora_name`; the simulator numbers no adapters.
            w.str("lora_id");
            w.nil();
            w.str("medium");
            w.str(vllm_medium(*medium));
            w.str("lora_name");
            match lora {
                Some(l) => w.str(l),
                None => w.nil(),
            }
            // One entry per block, untagged (`to_event_extra_keys`): the adapter's name on
            // every block, the salt only on the block at token 0 (`generate_block_hash_extra_keys`
            // salts the first block; later ones inherit it through the chained hash).
            w.str("extra_keys");
            w.array(nh);
            for b in 0..nh {
                let salted = salt.filter(|_| b == 0 && parent.is_none());
                let k = usize::from(lora.is_some()) + usize::from(salted.is_some());
                if k == 0 {
                    w.nil();
                    continue;
                }
                w.array(k);
                if let Some(l) = lora {
                    w.str(l);
                }
                if let Some(s) = salted {
                    w.str(s);
                }
            }
            w.str("group_idx");
            w.uint(0);
            w.str("kv_cache_spec_kind");
            w.str("full_attention");
            1
        }
        CacheEvent::Removed { hashes, medium } => {
            for &h in hashes {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.array(1);
                w.uhash(h);
                w.str("medium");
                w.str(vllm_medium(*medium));
                w.str("group_idx");
                w.uint(0);
            }
            hashes.len()
        }
        CacheEvent::Cleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
            1
        }
    }
}
