//! What a vLLM server announces at `GET /kv_event_sources`: its KV-event publishers, one per
//! data-parallel rank, each rank's `KVEventsConfig` as the engine resolved it. vLLM has no
//! `/get_server_info`, so this is how a vLLM fleet is subscribed without endpoint flags.
//!
//! Facts this parser rests on (vLLM 0.33.0): the answer is a JSON object keyed by DP rank
//! (`entrypoints/serve/instrumentator/basic.py`, `v1/engine/core_client.py`); a rank appears
//! once its engine is ready; each value holds `enable_kv_cache_events`, `publisher`, `endpoint`,
//! `replay_endpoint`, `topic` and buffer sizes, with the ports already offset by the rank
//! (`ZmqEventPublisher.__init__`) and `tcp://*:0` already resolved to the bound port; `{}` when
//! events are off. Pure: no sockets, no name resolution.

use super::discovery::{config_endpoint, ServerInfoError};
use crate::kv::endpoint::TcpEndpoint;

/// Path of the announcement.
pub const SOURCES_PATH: &str = "/kv_event_sources";

/// One DP rank's publisher, on the worker's own host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPublisher {
    /// The data-parallel rank (the index keeps each rank's blocks apart).
    pub rank: u32,
    /// The PUB socket.
    pub live: TcpEndpoint,
    /// The replay ROUTER socket, when the rank runs one.
    pub replay: Option<TcpEndpoint>,
}

/// Read `/kv_event_sources`: the ranks that publish over `tcp://`, sorted by rank. A rank with
/// events off, another publisher than `zmq`, or an `ipc://`/`inproc://` endpoint (unreachable
/// from another host) is left out. Whatever host a rank names, it is dialled on the worker's
/// own host, as for SGLang's `/get_server_info`: a worker cannot point the gateway's
/// connections elsewhere. An answer naming more than `max_ranks` ranks is refused before any
/// endpoint is read, and so is a rank numbered `max_ranks` or more.
pub fn parse_kv_event_sources(
    body: &[u8],
    worker_url: &str,
    max_ranks: u32,
) -> Result<Vec<RankPublisher>, ServerInfoError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(ServerInfoError::NotJson)?;
    let host = crate::kv::endpoint::url_host(worker_url)
        .ok_or_else(|| ServerInfoError::NoHost(worker_url.to_string()))?;
    let ranks = v
        .as_object()
        .ok_or_else(|| ServerInfoError::Sources("not a JSON object".into()))?;
    if ranks.len() > max_ranks as usize {
        return Err(ServerInfoError::TooManyRanks(ranks.len()));
    }
    let mut out = Vec::with_capacity(ranks.len());
    for (key, cfg) in ranks {
        // The canonical decimal form only ("0", never "00" or "+0": one rank, one key), and
        // below the bound, or the index would refuse every block of a rank it subscribed.
        let rank = key
            .parse::<u32>()
            .ok()
            .filter(|r| r.to_string() == *key)
            .ok_or_else(|| {
                ServerInfoError::Sources(format!("rank `{}` is not a number", shown(key)))
            })?;
        if rank >= max_ranks {
            return Err(ServerInfoError::Sources(format!(
                "rank {rank} is not below --kv-max-dp-ranks {max_ranks}"
            )));
        }
        let enabled = cfg
            .get("enable_kv_cache_events")
            .and_then(|e| e.as_bool())
            .unwrap_or(false);
        if !enabled || cfg.get("publisher").and_then(|p| p.as_str()) != Some("zmq") {
            continue;
        }
        let Some(live) = config_endpoint(cfg, "endpoint", host)? else {
            continue;
        };
        let replay = config_endpoint(cfg, "replay_endpoint", host)?;
        out.push(RankPublisher { rank, live, replay });
    }
    out.sort_unstable_by_key(|r| r.rank);
    Ok(out)
}

/// At most 32 characters of a server-given key, for an error message.
fn shown(s: &str) -> String {
    s.chars().take(32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(host: &str, port: u16) -> TcpEndpoint {
        TcpEndpoint {
            host: host.into(),
            port,
        }
    }

    /// vLLM 0.33.0's answer for two DP ranks started with
    /// `--kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557",
    /// "replay_endpoint":"tcp://*:5560","topic":"kv"}'`: each rank's config with its ports
    /// offset by the rank, keys as JSON strings.
    const TWO_RANKS: &str = r#"{
        "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",
              "replay_endpoint": "tcp://*:5561", "buffer_steps": 10000, "hwm": 100000,
              "max_queue_size": 100000, "topic": "kv"},
        "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5560", "buffer_steps": 10000, "hwm": 100000,
              "max_queue_size": 100000, "topic": "kv"}
    }"#;

    #[test]
    fn every_rank_is_dialled_on_the_workers_host_at_its_own_ports_in_rank_order() {
        let r = parse_kv_event_sources(TWO_RANKS.as_bytes(), "http://10.0.0.7:8000", 64).unwrap();
        assert_eq!(
            r,
            vec![
                RankPublisher {
                    rank: 0,
                    live: ep("10.0.0.7", 5557),
                    replay: Some(ep("10.0.0.7", 5560)),
                },
                RankPublisher {
                    rank: 1,
                    live: ep("10.0.0.7", 5558),
                    replay: Some(ep("10.0.0.7", 5561)),
                },
            ]
        );
    }

    #[test]
    fn a_resolved_or_foreign_host_is_replaced_by_the_workers_own() {
        // `tcp://*:0` comes back resolved to the node's IP and the bound port; another host
        // (a connect-mode publisher, or a lie) is never dialled.
        let body = br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://192.168.9.9:41234", "replay_endpoint": null}}"#;
        let r = parse_kv_event_sources(body, "http://[fd00::7]:8000", 64).unwrap();
        assert_eq!(
            r,
            vec![RankPublisher {
                rank: 0,
                live: ep("[fd00::7]", 41234),
                replay: None,
            }]
        );
    }

    #[test]
    fn ranks_without_reachable_events_are_left_out() {
        let body = br#"{
            "0": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5557"},
            "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/kv"},
            "2": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5559",
                  "replay_endpoint": "ipc:///tmp/replay"}
        }"#;
        let r = parse_kv_event_sources(body, "http://h:1", 64).unwrap();
        assert_eq!(
            r,
            vec![RankPublisher {
                rank: 2,
                live: ep("h", 5559),
                replay: None,
            }]
        );
        // Events off, or a render-only server.
        assert!(parse_kv_event_sources(b"{}", "http://h:1", 64)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn malformed_answers_are_refused_with_the_reason() {
        for (body, want) in [
            (&b"not json"[..], "not JSON"),
            (b"[1]", "not a JSON object"),
            (br#"{"zero": {}}"#, "rank `zero` is not a number"),
            (br#"{"00": {}}"#, "rank `00` is not a number"),
            (br#"{"+1": {}}"#, "rank `+1` is not a number"),
            (br#"{"64": {}}"#, "rank 64 is not below --kv-max-dp-ranks 64"),
            (
                br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:99999"}}"#,
                "port",
            ),
        ] {
            let e = parse_kv_event_sources(body, "http://h:1", 64).unwrap_err();
            assert!(e.to_string().contains(want), "{e} for {body:?}");
        }
        assert!(matches!(
            parse_kv_event_sources(TWO_RANKS.as_bytes(), "not-a-url", 64),
            Err(ServerInfoError::NoHost(_))
        ));
    }

    #[test]
    fn more_ranks_than_allowed_are_refused_before_any_is_read() {
        let many: String = (0..65)
            .map(|r| format!(r#""{r}": {{"endpoint": "bad"}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let e =
            parse_kv_event_sources(format!("{{{many}}}").as_bytes(), "http://h:1", 64).unwrap_err();
        assert!(matches!(e, ServerInfoError::TooManyRanks(65)), "{e}");
        assert_eq!(
            parse_kv_event_sources(TWO_RANKS.as_bytes(), "http://h:1", 2)
                .unwrap()
                .len(),
            2
        );
    }
}
