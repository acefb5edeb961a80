//! Ports without races. A number picked by binding port 0 and letting go can be taken by anyone
//! before the server it was picked for binds it (another test's listener or outgoing
//! connection, two tests at a time in one process, other processes on the machine). So:
//!
//! - an in-process server binds port 0 itself, or is handed the listener bound here
//!   ([`listener_run`] for consecutive ports);
//! - a port where nothing may listen is held by a bound socket that never listens
//!   ([`ClosedPort`]): connections are refused, and nobody else can bind it;
//! - a server that must bind a number it is told (a child process, a Python publisher, a
//!   gateway's metrics listener) gets a [`Reserved`] one, and a child process that fails to
//!   start on it anyway is started again on another ([`super::spawn_on_ports`]).

use socket2::{Domain, Socket, Type};
use std::net::{SocketAddr, TcpListener};

/// Attempts at finding a run of consecutive ports before a test fails.
const RUN_TRIES: usize = 200;
/// Lowest port a run is drawn from (under it: well-known and registered services).
const RUN_LOW: u16 = 10_000;

/// A port number held for a server that binds it itself: a socket bound to it with
/// `SO_REUSEADDR`, never listening. Linux lets a listener that also sets `SO_REUSEADDR` (std's
/// `TcpListener::bind`, the gateway's listeners, libzmq) bind the number beside it, while a bind
/// to port 0 or an outgoing connection never gets it, so nothing else takes it meanwhile.
/// Dropping it lets go of the number (the server, once bound, keeps it).
pub struct Reserved {
    _socket: Socket,
    pub port: u16,
}

/// A port where nothing listens, held so that nothing can: a socket bound without
/// `SO_REUSEADDR` that never listens. Connections to it are refused (reset), as to a peer that
/// is not there, for as long as it lives.
pub struct ClosedPort {
    _socket: Socket,
    pub port: u16,
}

/// A fresh TCP socket for 127.0.0.1-style addresses.
fn socket() -> Socket {
    Socket::new(Domain::IPV4, Type::STREAM, None).expect("a TCP socket")
}

/// The port `s` is bound to.
fn port_of(s: &Socket) -> u16 {
    s.local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .map(|a| a.port())
        .expect("a bound socket has a port")
}

/// Bind `s` to `ip:port`; false when the number is taken.
fn bind(s: &Socket, ip: [u8; 4], port: u16) -> bool {
    s.bind(&SocketAddr::from((ip, port)).into()).is_ok()
}

/// A port on 127.0.0.1 reserved for a server that binds it itself.
pub fn reserve() -> Reserved {
    let s = socket();
    s.set_reuse_address(true).expect("SO_REUSEADDR");
    assert!(bind(&s, [127, 0, 0, 1], 0), "bind 127.0.0.1:0");
    let port = port_of(&s);
    Reserved { _socket: s, port }
}

/// A port on 127.0.0.1 where nothing listens, and nothing else can bind while it is held.
pub fn closed_port() -> ClosedPort {
    let s = socket();
    assert!(bind(&s, [127, 0, 0, 1], 0), "bind 127.0.0.1:0");
    let port = port_of(&s);
    ClosedPort { _socket: s, port }
}

/// The first port of the kernel's ephemeral range (`ip_local_port_range`, 32768 by default):
/// binds to port 0 and outgoing connections take their ports from there on.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A number from a small xorshift generator seeded by the clock and the process, so that runs
/// drawn by two tests (or two processes) at once start in different places.
fn draw() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        x = nanos ^ (u64::from(std::process::id()) << 32) | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    x
}

/// `n` consecutive ports on `ip`, each bound by a socket (none listening yet). The base is
/// drawn under the ephemeral range, where neither binds to port 0 nor outgoing connections
/// (nor the `TIME_WAIT` they leave behind) take numbers, and a run with a taken port is let go
/// and drawn again. Bound without `SO_REUSEADDR`, so a run shares no number with anything, a
/// reservation included; `reuse_after` sets it once bound (a reservation itself).
fn run(ip: [u8; 4], n: u16, reuse_after: bool) -> Vec<Socket> {
    assert!(n >= 1);
    let low = ephemeral_low();
    // Above the ephemeral range when there is no room under it.
    let (from, to) = if low >= RUN_LOW + n {
        (RUN_LOW, low - n)
    } else {
        (61_000, 65_535 - n)
    };
    for _ in 0..RUN_TRIES {
        let base = from + (draw() % u64::from(to - from + 1)) as u16;
        let mut held = Vec::new();
        for r in 0..n {
            let s = socket();
            if !bind(&s, ip, base + r) {
                break;
            }
            held.push(s);
        }
        if held.len() == usize::from(n) {
            if reuse_after {
                for s in &held {
                    s.set_reuse_address(true).expect("SO_REUSEADDR");
                }
            }
            return held;
        }
    }
    panic!("no run of {n} free ports on {ip:?} in {RUN_TRIES} tries");
}

/// `n` consecutive ports on 127.0.0.1 reserved (as [`Reserved`]) for a server that binds them
/// itself, one per DP rank from a base, as SGLang's publishers do.
pub struct ReservedRun {
    _sockets: Vec<Socket>,
    pub base: u16,
}

pub fn reserve_run(n: u16) -> ReservedRun {
    let sockets = run([127, 0, 0, 1], n, true);
    let base = port_of(&sockets[0]);
    ReservedRun {
        _sockets: sockets,
        base,
    }
}

/// `n` consecutive ports on 127.0.0.1 where nothing listens (as [`ClosedPort`]).
pub struct ClosedRun {
    _sockets: Vec<Socket>,
    pub base: u16,
}

pub fn closed_run(n: u16) -> ClosedRun {
    let sockets = run([127, 0, 0, 1], n, false);
    let base = port_of(&sockets[0]);
    ClosedRun {
        _sockets: sockets,
        base,
    }
}

/// Listeners on `n` consecutive ports of `ip`, for in-process servers that stand for one DP
/// rank each.
pub fn listener_run(ip: [u8; 4], n: u16) -> Vec<TcpListener> {
    run(ip, n, false)
        .into_iter()
        .map(|s| {
            s.listen(1024).expect("listen");
            s.into()
        })
        .collect()
}

/// Listeners on the same port number of two addresses (one server, and a probe counting what
/// reaches the other address), the number drawn on `a` and retried while `b` has it taken.
pub fn listener_pair(a: [u8; 4], b: [u8; 4]) -> (TcpListener, TcpListener) {
    for _ in 0..RUN_TRIES {
        let first = TcpListener::bind(SocketAddr::from((a, 0))).expect("bind a listener");
        let port = first.local_addr().expect("bound").port();
        if let Ok(second) = TcpListener::bind(SocketAddr::from((b, port))) {
            return (first, second);
        }
    }
    panic!("no port free on both {a:?} and {b:?} in {RUN_TRIES} tries");
}

/// A listener on 127.0.0.1 whose run of `n` ports from it goes past 65535 (the rest of the run
/// does not exist), bound at once rather than found free and bound later.
pub fn listener_near_the_top(n: u16) -> TcpListener {
    (65536 - u32::from(n) + 1..=65535)
        .find_map(|p| TcpListener::bind(("127.0.0.1", p as u16)).ok())
        .expect("a free port near 65535")
}
