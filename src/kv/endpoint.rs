//! Where the event intake subscribes: the `WORKER_URL=tcp://HOST:PORT` flag syntax, the pairing
//! of live and replay endpoints per worker, SGLang's DP-rank rule (rank r publishes on the base
//! port plus r, its replay socket likewise) and the wildcard host a server reports for a socket
//! it binds (`tcp://*:5557` means "this server's host"). Pure: no sockets, no name resolution.

/// A ZeroMQ `tcp://HOST:PORT` endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// A name, an IPv4 address, a bracketed IPv6 literal (`[::1]`) or a wildcard (`*`).
    pub host: String,
    /// The TCP port.
    pub port: u16,
}

impl TcpEndpoint {
    /// Parse `tcp://HOST:PORT` (the only transport that reaches another machine).
    pub fn parse(s: &str) -> Result<TcpEndpoint, String> {
        let bad = |why: &str| format!("KV-event endpoint `{}`: {why}", shown(s));
        let rest = s
            .strip_prefix("tcp://")
            .ok_or_else(|| bad("must be tcp://HOST:PORT"))?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| bad("a port is required"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| bad("the port must be 1-65535"))?;
        let ok_host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => {
                host == "*"
                    || (!host.is_empty()
                        && host.len() <= 253
                        && host
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-'))
            }
        };
        if !ok_host {
            return Err(bad("the host must be a name, an IPv4 address, [IPv6] or *"));
        }
        Ok(TcpEndpoint {
            host: host.to_string(),
            port,
        })
    }

    /// The endpoint attention-DP rank `rank` publishes on: SGLang (and vLLM) offset the port of
    /// the configured endpoint by the rank, for the live and the replay socket alike.
    pub fn for_rank(&self, rank: u32) -> Result<TcpEndpoint, String> {
        let port = u32::from(self.port) + rank;
        let port = u16::try_from(port)
            .map_err(|_| format!("{}: port + DP rank {rank} is over 65535", self.url()))?;
        Ok(TcpEndpoint {
            host: self.host.clone(),
            port,
        })
    }

    /// Whether the host means "every interface of the server" (a bound socket as the server
    /// reports it), which a subscriber must replace by the server's own host.
    pub fn is_wildcard(&self) -> bool {
        matches!(
            self.host.as_str(),
            "*" | "0.0.0.0" | "[::]" | "[0:0:0:0:0:0:0:0]"
        )
    }

    /// This endpoint with a wildcard host replaced by the host of `worker_url`
    /// (`http://HOST:PORT`); unchanged when the host is concrete or the URL has none.
    pub fn with_host_of(&self, worker_url: &str) -> TcpEndpoint {
        match (self.is_wildcard(), url_host(worker_url)) {
            (true, Some(host)) => TcpEndpoint {
                host: host.to_string(),
                port: self.port,
            },
            _ => self.clone(),
        }
    }

    /// The endpoint as ZeroMQ spells it (`tcp://HOST:PORT`), for logs and flags.
    pub fn url(&self) -> String {
        format!("tcp://{}:{}", self.host, self.port)
    }
}

/// The host part of `http://HOST:PORT/...` (brackets kept for IPv6).
pub fn url_host(url: &str) -> Option<&str> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))?;
    let authority = rest.split('/').next()?;
    let host = if authority.starts_with('[') {
        &authority[..=authority.find(']')?]
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    (!host.is_empty()).then_some(host)
}

/// One `WORKER_URL=tcp://HOST:PORT` value of `--kv-events-endpoints` or
/// `--kv-events-replay-endpoints`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// The worker's base URL as given (the caller validates it as a worker URL).
    pub worker_url: String,
    /// Where that worker's (rank-0) socket is.
    pub endpoint: TcpEndpoint,
}

/// Split and parse `WORKER_URL=tcp://HOST:PORT` (worker URLs never contain `=`). A wildcard host
/// is replaced by the worker's host, as for endpoints read from the server.
pub fn parse_worker_endpoint(s: &str) -> Result<WorkerEndpoint, String> {
    let (url, ep) = s
        .split_once('=')
        .ok_or_else(|| format!("`{}`: expected WORKER_URL=tcp://HOST:PORT", shown(s)))?;
    let worker_url = url.trim_end_matches('/').to_string();
    if worker_url.is_empty() {
        return Err(format!("`{}`: the worker URL is empty", shown(s)));
    }
    let endpoint = TcpEndpoint::parse(ep)?.with_host_of(&worker_url);
    Ok(WorkerEndpoint {
        worker_url,
        endpoint,
    })
}

/// One worker's event sockets: where its rank-0 publisher and (optionally) replay server are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoints {
    /// The worker's base URL.
    pub worker_url: String,
    /// The PUB socket of DP rank 0.
    pub live: TcpEndpoint,
    /// The replay ROUTER socket of DP rank 0, when the server runs one.
    pub replay: Option<TcpEndpoint>,
}

impl KvEndpoints {
    /// The live and replay endpoints of attention-DP rank `rank` (port + rank).
    pub fn for_rank(&self, rank: u32) -> Result<(TcpEndpoint, Option<TcpEndpoint>), String> {
        let replay = match &self.replay {
            Some(r) => Some(r.for_rank(rank)?),
            None => None,
        };
        Ok((self.live.for_rank(rank)?, replay))
    }
}

/// Pair the two flag lists by worker: each worker at most once per list, and a replay endpoint
/// only for a worker whose live endpoint is given too (a replay socket alone delivers nothing),
/// and never the same socket for both.
pub fn pair_endpoints(
    live: &[WorkerEndpoint],
    replay: &[WorkerEndpoint],
) -> Result<Vec<KvEndpoints>, String> {
    let mut out: Vec<KvEndpoints> = Vec::with_capacity(live.len());
    for l in live {
        if out.iter().any(|o| o.worker_url == l.worker_url) {
            return Err(format!(
                "--kv-events-endpoints names {} twice",
                l.worker_url
            ));
        }
        out.push(KvEndpoints {
            worker_url: l.worker_url.clone(),
            live: l.endpoint.clone(),
            replay: None,
        });
    }
    for r in replay {
        let Some(o) = out.iter_mut().find(|o| o.worker_url == r.worker_url) else {
            return Err(format!(
                "--kv-events-replay-endpoints names {} but --kv-events-endpoints does not",
                r.worker_url
            ));
        };
        if o.replay.is_some() {
            return Err(format!(
                "--kv-events-replay-endpoints names {} twice",
                r.worker_url
            ));
        }
        if o.live == r.endpoint {
            return Err(format!(
                "{}: the replay endpoint {} is the live endpoint",
                r.worker_url,
                r.endpoint.url()
            ));
        }
        o.replay = Some(r.endpoint.clone());
    }
    Ok(out)
}

/// At most 80 characters of untrusted text for an error message.
fn shown(s: &str) -> String {
    s.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn we(url: &str, ep: &str) -> WorkerEndpoint {
        parse_worker_endpoint(&format!("{url}={ep}")).unwrap()
    }

    #[test]
    fn tcp_endpoints_parse_and_refuse() {
        let e = TcpEndpoint::parse("tcp://10.0.0.5:5557").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("10.0.0.5", 5557));
        assert_eq!(e.url(), "tcp://10.0.0.5:5557");
        let v6 = TcpEndpoint::parse("tcp://[::1]:5557").unwrap();
        assert_eq!(v6.url(), "tcp://[::1]:5557");
        assert!(TcpEndpoint::parse("tcp://*:5557").unwrap().is_wildcard());
        for bad in [
            "5557",
            "ipc:///tmp/kv",
            "tcp://host",
            "tcp://host:0",
            "tcp://host:65536",
            "tcp://:5557",
            "tcp://ho st:1",
            "tcp://[zz]:1",
            "tcp://a/b:1",
        ] {
            assert!(TcpEndpoint::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn dp_rank_adds_to_the_port_and_refuses_overflow() {
        let e = TcpEndpoint::parse("tcp://w:5557").unwrap();
        assert_eq!(e.for_rank(0).unwrap().port, 5557);
        assert_eq!(e.for_rank(3).unwrap().port, 5560);
        assert!(TcpEndpoint::parse("tcp://w:65535")
            .unwrap()
            .for_rank(1)
            .is_err());
        let k = KvEndpoints {
            worker_url: "http://w:30000".into(),
            live: e.clone(),
            replay: Some(TcpEndpoint::parse("tcp://w:5558").unwrap()),
        };
        let (l, r) = k.for_rank(2).unwrap();
        assert_eq!((l.port, r.unwrap().port), (5559, 5560));
    }

    #[test]
    fn wildcard_hosts_become_the_workers_host() {
        let e = TcpEndpoint::parse("tcp://*:5557").unwrap();
        assert_eq!(
            e.with_host_of("http://10.1.2.3:30000").url(),
            "tcp://10.1.2.3:5557"
        );
        assert_eq!(
            e.with_host_of("http://[fd00::1]:30000/").url(),
            "tcp://[fd00::1]:5557"
        );
        let any4 = TcpEndpoint::parse("tcp://0.0.0.0:5557").unwrap();
        assert_eq!(
            any4.with_host_of("http://gpu-7:30000").url(),
            "tcp://gpu-7:5557"
        );
        let concrete = TcpEndpoint::parse("tcp://10.9.9.9:5557").unwrap();
        assert_eq!(concrete.with_host_of("http://gpu-7:30000"), concrete);
        assert_eq!(url_host("nonsense"), None);
    }

    #[test]
    fn flag_values_pair_by_worker() {
        let live = [
            we("http://a:1", "tcp://*:5557"),
            we("http://b:1/", "tcp://10.0.0.2:5557"),
        ];
        assert_eq!(live[0].endpoint.url(), "tcp://a:5557");
        assert_eq!(live[1].worker_url, "http://b:1");
        let replay = [we("http://a:1", "tcp://a:5558")];
        let pairs = pair_endpoints(&live, &replay).unwrap();
        assert_eq!(pairs.len(), 2);
        assert_eq!(pairs[0].replay.as_ref().unwrap().port, 5558);
        assert_eq!(pairs[1].replay, None);

        assert!(pair_endpoints(&[live[0].clone(), live[0].clone()], &[]).is_err());
        assert!(pair_endpoints(&live, &[we("http://c:1", "tcp://c:5558")]).is_err());
        assert!(pair_endpoints(&live, &[replay[0].clone(), replay[0].clone()]).is_err());
        assert!(pair_endpoints(&live, &[we("http://a:1", "tcp://a:5557")]).is_err());
        for bad in ["http://a:1", "=tcp://a:1", "http://a:1=tcp://a"] {
            assert!(parse_worker_endpoint(bad).is_err(), "{bad}");
        }
    }
}
