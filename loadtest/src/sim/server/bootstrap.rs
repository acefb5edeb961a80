//! The PD bootstrap handshake over real sockets (the pure parts live in
//! [`disagg`](crate::sim::disagg)): a prefill server answers room queries on its bootstrap
//! port; a decode server asks the named prefill server until the room's prefill is done.

use std::net::ToSocketAddrs;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

use crate::sim::disagg::{
    answer_line, parse_answer, parse_query, BootstrapFields, RoomState, UNKNOWN_ROOM_GRACE,
};

use super::Server;

/// Pause between two queries about a room that is not ready yet.
const POLL: Duration = Duration::from_millis(2);
/// Longest a decode request waits for a room's prefill to finish.
const READY_WAIT: Duration = Duration::from_secs(120);
/// Longest query line accepted.
const MAX_LINE: usize = 64;

/// Prefill side: answer `ROOM <n>` lines on the bootstrap listener until shutdown.
pub(super) async fn serve_rooms(sh: Rc<Server>, listener: TcpListener) {
    loop {
        monoio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    monoio::spawn(room_queries(sh.clone(), stream));
                }
                Err(_) => monoio::time::sleep(Duration::from_millis(10)).await,
            },
            _ = sh.shutdown.wait() => break,
        }
    }
}

/// One bootstrap connection: one answer line per query line.
async fn room_queries(sh: Rc<Server>, mut stream: TcpStream) {
    let mut pending: Vec<u8> = Vec::with_capacity(MAX_LINE);
    let mut buf = vec![0u8; 256];
    loop {
        let (r, b) = monoio::select! {
            r = stream.read(buf) => r,
            _ = sh.shutdown.wait() => return,
        };
        buf = b;
        let n = match r {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some(end) = pending.iter().position(|&c| c == b'\n') {
            let state = parse_query(&pending[..end])
                .and_then(|room| sh.rooms.borrow().get(room, Instant::now()));
            pending.drain(..=end);
            let (w, _) = stream.write_all(answer_line(state)).await;
            if w.is_err() {
                return;
            }
        }
        if pending.len() > MAX_LINE {
            return;
        }
    }
}

/// Decode side: wait until every room of `f` is ready on the prefill server it names (its
/// host, and its port or this server's default). `Err` carries the reason the request fails.
pub(super) async fn await_rooms(sh: &Server, f: &BootstrapFields) -> Result<(), String> {
    let host = f
        .host
        .as_deref()
        .ok_or("bootstrap_host is required in disaggregation mode")?;
    let port = f.port.unwrap_or(sh.cfg.disaggregation_bootstrap_port);
    let addr = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("cannot resolve bootstrap server {host}:{port}"))?;
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("bootstrap server {host}:{port} unreachable: {e}"))?;
    for &room in &f.rooms {
        let started = Instant::now();
        loop {
            match ask(&mut stream, room).await? {
                Some(RoomState::Ready) => break,
                Some(RoomState::Failed) => {
                    return Err(format!("the prefill of bootstrap_room {room} failed"));
                }
                None if started.elapsed() > UNKNOWN_ROOM_GRACE => {
                    return Err(format!(
                        "bootstrap_room {room} is not registered on {host}:{port}"
                    ));
                }
                _ if started.elapsed() > READY_WAIT => {
                    return Err(format!("bootstrap_room {room}: prefill timed out"));
                }
                _ => {}
            }
            monoio::select! {
                _ = monoio::time::sleep(POLL) => {}
                _ = sh.shutdown.wait() => return Err("server shutting down".into()),
            }
        }
    }
    Ok(())
}

/// One query and its answer line.
async fn ask(stream: &mut TcpStream, room: u64) -> Result<Option<RoomState>, String> {
    let lost = |e: std::io::Error| format!("bootstrap connection lost: {e}");
    let (w, _) = stream
        .write_all(format!("ROOM {room}\n").into_bytes())
        .await;
    w.map_err(lost)?;
    let mut line: Vec<u8> = Vec::with_capacity(16);
    let mut buf = vec![0u8; 16];
    loop {
        let (r, b) = stream.read(buf).await;
        buf = b;
        match r {
            Ok(0) => return Err("bootstrap connection closed".into()),
            Ok(n) => line.extend_from_slice(&buf[..n]),
            Err(e) => return Err(lost(e)),
        }
        if let Some(end) = line.iter().position(|&c| c == b'\n') {
            return parse_answer(&line[..end]);
        }
        if line.len() > MAX_LINE {
            return Err("bootstrap answer too long".into());
        }
    }
}
