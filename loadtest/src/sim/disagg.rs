//! Prefill/decode disaggregation in the simulated worker (SGLang's `--disaggregation-mode` and
//! `--disaggregation-bootstrap-port`), the pure parts: the mode, the bootstrap fields a paired
//! request carries, the prefill side's book of bootstrap rooms, and the line protocol the decode
//! side uses to ask a prefill server about a room.
//!
//! The handshake, as the simulator plays it: a prefill server registers each request's room
//! when the request arrives (`prefilling`), marks it `ready` when its prefill is done (the KV
//! cache could be handed over) or `failed` when it was aborted. A decode server connects to the
//! named prefill's bootstrap port (a real TCP listener) and asks `ROOM <n>\n` until the answer
//! is `READY` (then it generates, charged only the decode cost: the prompt's KV arrived), or
//! fails the request as SGLang does when the room is unknown past a grace period, the prefill
//! failed, or its bootstrap server is unreachable.

use serde_json::Value;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// How long a room is remembered after it was registered.
pub const ROOM_TTL: Duration = Duration::from_secs(120);

/// How long a decode request waits for an unknown room to be registered by its prefill twin
/// (both requests are sent at once, so the decode one may arrive first).
pub const UNKNOWN_ROOM_GRACE: Duration = Duration::from_secs(5);

/// The part a server plays (`--disaggregation-mode`; none: a regular server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisaggMode {
    /// Computes the prompt (then one token) and registers bootstrap rooms.
    Prefill,
    /// Generates from a prompt handed over by a prefill server.
    Decode,
}

impl DisaggMode {
    /// `prefill`, `decode`, or `null` (none), as SGLang spells them.
    pub fn parse(s: &str) -> Result<Option<DisaggMode>, String> {
        match s {
            "prefill" => Ok(Some(DisaggMode::Prefill)),
            "decode" => Ok(Some(DisaggMode::Decode)),
            "null" | "none" => Ok(None),
            other => Err(format!(
                "--disaggregation-mode: `{other}` is not prefill, decode or null"
            )),
        }
    }

    /// The mode's name.
    pub fn as_str(self) -> &'static str {
        match self {
            DisaggMode::Prefill => "prefill",
            DisaggMode::Decode => "decode",
        }
    }
}

/// The bootstrap fields of one paired request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapFields {
    /// The prefill server's host, when given.
    pub host: Option<String>,
    /// The prefill server's bootstrap port (`None`: JSON null or absent).
    pub port: Option<u16>,
    /// One room per prompt (a single room for a single request).
    pub rooms: Vec<u64>,
}

impl BootstrapFields {
    /// The fields as `/debug/stats` reports them.
    pub fn to_json(&self) -> Value {
        serde_json::json!({"host": self.host, "port": self.port, "rooms": self.rooms})
    }
}

/// Read the bootstrap fields of a request body. `Err` when `bootstrap_room` is absent or of the
/// wrong type, or its count does not match the request's `prompts` (what SGLang refuses).
pub fn bootstrap_fields(body: &[u8], prompts: usize) -> Result<BootstrapFields, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let room = v.get("bootstrap_room").unwrap_or(&Value::Null);
    let rooms = match room {
        Value::Null => {
            return Err("bootstrap_room is required in disaggregation mode".into());
        }
        Value::Number(n) => vec![n.as_u64().ok_or("bootstrap_room must be an integer")?],
        Value::Array(items) => items
            .iter()
            .map(|r| r.as_u64().ok_or("bootstrap_room items must be integers"))
            .collect::<Result<Vec<u64>, _>>()?,
        _ => return Err("bootstrap_room must be an integer or a list".into()),
    };
    if rooms.len() != prompts {
        return Err(format!(
            "bootstrap_room has {} room(s) for {prompts} prompt(s)",
            rooms.len()
        ));
    }
    let host = match v.get("bootstrap_host") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("bootstrap_host must be a string".into()),
    };
    let port = match v.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(p) => Some(
            p.as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .ok_or("bootstrap_port must be a port number or null")?,
        ),
    };
    Ok(BootstrapFields { host, port, rooms })
}

/// PD `/generate` with `return_logprob`: each prompt's `meta_info.input_token_logprobs`, as
/// `[logprob, token_id, null]` from `logprob_start_len` on. The prefill server computed the
/// prompt, so it reports them (made-up but deterministic values); the decode server did not, so
/// its lists are empty and the gateway puts the prefill's in front. `None` when not asked for.
pub fn input_logprobs(mode: DisaggMode, body: &[u8], prompts: &[Vec<u32>]) -> Option<Vec<Value>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    if v.get("return_logprob") != Some(&Value::Bool(true)) {
        return None;
    }
    let start = v
        .get("logprob_start_len")
        .and_then(Value::as_i64)
        .filter(|&n| n >= 0)
        .map_or(usize::MAX, |n| n as usize);
    Some(
        prompts
            .iter()
            .map(|p| match mode {
                DisaggMode::Decode => Value::Array(Vec::new()),
                DisaggMode::Prefill => p
                    .iter()
                    .skip(start.min(p.len()))
                    .map(|&t| serde_json::json!([-1.0 - f64::from(t % 7) / 10.0, t, null]))
                    .collect(),
            })
            .collect(),
    )
}

/// A rendered `/generate` answer (one object, or a list for a batch) with each item's
/// `meta_info.input_token_logprobs` set from `lists`.
pub fn with_input_logprobs(body: &[u8], lists: &[Value]) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let items: Vec<&mut Value> = match &mut v {
        Value::Array(a) => a.iter_mut().collect(),
        one => vec![one],
    };
    for (item, lp) in items.into_iter().zip(lists) {
        item.get_mut("meta_info")?
            .as_object_mut()?
            .insert("input_token_logprobs".into(), lp.clone());
    }
    serde_json::to_vec(&v).ok()
}

/// A room's state on its prefill server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomState {
    /// Registered; its prefill is running.
    Prefilling,
    /// Prefill done: the KV cache can be handed over.
    Ready,
    /// The prefill was aborted or failed.
    Failed,
}

/// The prefill server's rooms, forgotten after [`ROOM_TTL`].
#[derive(Debug, Default)]
pub struct RoomBook {
    rooms: HashMap<u64, (RoomState, Instant)>,
}

impl RoomBook {
    /// Set a room's state (registering it when new).
    pub fn set(&mut self, room: u64, state: RoomState, now: Instant) {
        if self.rooms.len() > 4096 {
            self.rooms
                .retain(|_, (_, at)| now.duration_since(*at) < ROOM_TTL);
        }
        let at = self.rooms.get(&room).map_or(now, |&(_, at)| at);
        self.rooms.insert(room, (state, at));
    }

    /// A room's state, unless unknown or expired.
    pub fn get(&self, room: u64, now: Instant) -> Option<RoomState> {
        self.rooms
            .get(&room)
            .filter(|(_, at)| now.duration_since(*at) < ROOM_TTL)
            .map(|&(s, _)| s)
    }
}

/// The answer to a room query, one line.
pub fn answer_line(state: Option<RoomState>) -> &'static [u8] {
    match state {
        None => b"UNKNOWN\n",
        Some(RoomState::Prefilling) => b"WAIT\n",
        Some(RoomState::Ready) => b"READY\n",
        Some(RoomState::Failed) => b"FAILED\n",
    }
}

/// A query line (`ROOM <n>`, without its newline) → the room asked about.
pub fn parse_query(line: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(line).ok()?.trim();
    s.strip_prefix("ROOM ")?.trim().parse().ok()
}

/// An answer line (without its newline) → the state it reports (`None`: unknown room).
pub fn parse_answer(line: &[u8]) -> Result<Option<RoomState>, String> {
    match std::str::from_utf8(line).map(str::trim) {
        Ok("UNKNOWN") => Ok(None),
        Ok("WAIT") => Ok(Some(RoomState::Prefilling)),
        Ok("READY") => Ok(Some(RoomState::Ready)),
        Ok("FAILED") => Ok(Some(RoomState::Failed)),
        _ => Err(format!(
            "bad bootstrap answer `{}`",
            String::from_utf8_lossy(line)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_and_checked() {
        let f = bootstrap_fields(
            br#"{"text":"a","bootstrap_host":"127.0.0.1","bootstrap_port":9,"bootstrap_room":5}"#,
            1,
        )
        .unwrap();
        assert_eq!(f.rooms, vec![5]);
        assert_eq!((f.host.as_deref(), f.port), (Some("127.0.0.1"), Some(9)));
        let f = bootstrap_fields(br#"{"bootstrap_port":null,"bootstrap_room":[1,2]}"#, 2).unwrap();
        assert_eq!((f.host, f.port, f.rooms), (None, None, vec![1, 2]));
        assert!(bootstrap_fields(br#"{"text":"a"}"#, 1).is_err());
        assert!(bootstrap_fields(br#"{"bootstrap_room":[1]}"#, 2).is_err());
        assert!(bootstrap_fields(br#"{"bootstrap_room":"x"}"#, 1).is_err());
    }

    #[test]
    fn input_logprobs_come_from_the_prefill_side_only() {
        let body = br#"{"return_logprob":true,"logprob_start_len":1}"#;
        let prompts = vec![vec![10, 11, 12]];
        let p = input_logprobs(DisaggMode::Prefill, body, &prompts).unwrap();
        assert_eq!(
            p[0].as_array().unwrap().len(),
            2,
            "from logprob_start_len on"
        );
        assert_eq!(p[0][0][1], 11);
        let d = input_logprobs(DisaggMode::Decode, body, &prompts).unwrap();
        assert_eq!(d[0], serde_json::json!([]));
        assert!(input_logprobs(DisaggMode::Prefill, b"{}", &prompts).is_none());
        let out = with_input_logprobs(br#"{"text":"x","meta_info":{"id":"a"}}"#, &p).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"], p[0]);
        assert_eq!(v["meta_info"]["id"], "a");
    }

    #[test]
    fn rooms_expire_and_the_protocol_round_trips() {
        let mut b = RoomBook::default();
        let t = Instant::now();
        b.set(7, RoomState::Prefilling, t);
        assert_eq!(b.get(7, t), Some(RoomState::Prefilling));
        b.set(7, RoomState::Ready, t + Duration::from_secs(1));
        assert_eq!(b.get(7, t + Duration::from_secs(2)), Some(RoomState::Ready));
        assert_eq!(b.get(7, t + ROOM_TTL), None, "expired");
        assert_eq!(b.get(8, t), None);
        for s in [
            None,
            Some(RoomState::Prefilling),
            Some(RoomState::Ready),
            Some(RoomState::Failed),
        ] {
            let line = answer_line(s);
            assert_eq!(parse_answer(&line[..line.len() - 1]), Ok(s));
        }
        assert_eq!(parse_query(b"ROOM 42"), Some(42));
        assert_eq!(parse_query(b"ROOM x"), None);
        assert!(parse_answer(b"huh").is_err());
        assert_eq!(DisaggMode::parse("null"), Ok(None));
        assert!(DisaggMode::parse("both").is_err());
    }
}
