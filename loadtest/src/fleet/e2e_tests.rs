//! A small fleet end to end: 4 servers × 2 ranks on 127.0.0.1, real ZeroMQ SUBs and a DEALER
//! (the `zmq` crate: libzmq, as pyzmq and SGLang) receive in-sequence batches that the
//! gateway's own decoder reads, replay returns them byte for byte, and the HTTP side answers
//! what the gateway asks.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use clap::Parser;
use radixgate::kv::wire::{decode_batch, KvEvent};

use super::client::Client;
use super::schedule::{parse_rates, Schedule};
use super::*;

const DEADLINE: Duration = Duration::from_secs(10);

/// Port bases unlikely to be taken: below the ephemeral range, spread by the process id.
fn bases() -> (u16, u16, u16) {
    let k = (std::process::id() % 300) as u16 * 16;
    (23_000 + k, 28_000 + k, 18_000 + k)
}

#[test]
fn a_small_fleet_publishes_in_sequence_replays_and_answers_http() {
    let (http, pubb, replay) = bases();
    let args = FleetArgs::parse_from([
        "kv-fleet",
        "--servers=4",
        "--dp=2",
        "--replay-batches=100000",
        "--replay-bytes=100000000",
        "--blocks-per-rank=300",
        &format!("--http-base={http}"),
        &format!("--pub-base={pubb}"),
        &format!("--replay-base={replay}"),
        "--gen-nice=0",
    ]);
    let mut fleet = Fleet::start(args.clone()).expect("fleet starts");
    assert_eq!(fleet.seeds.len(), 8, "one seed per rank");

    // HTTP: what discovery reads, and an answer naming the server.
    let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, http + 1));
    let mut c = Client::new(addr, DEADLINE);
    let (st, body) = c.request("GET", "/get_server_info", b"").unwrap();
    assert_eq!(st, 200);
    let info = radixgate::gateway::kv_routing::parse_server_info(
        &body,
        &format!("http://127.0.0.1:{}", http + 1),
    )
    .unwrap();
    assert_eq!(info.ranks, 2);
    assert_eq!(info.live.unwrap().port, pubb + 2);
    assert_eq!(info.replay.unwrap().port, replay + 2);
    let (st, body) = c
        .request("POST", "/generate", &driver::generate_body(&[1, 2, 3]))
        .unwrap();
    assert_eq!(st, 200);
    assert_eq!(driver::answered_by(&body), Some(1));

    // Subscribe every rank, then run a short schedule.
    let ctx = zmq::Context::new();
    let subs: Vec<zmq::Socket> = (0..4)
        .flat_map(|s| (0..2).map(move |r| (s, r)))
        .map(|(s, r)| {
            let sock = ctx.socket(zmq::SUB).unwrap();
            sock.set_subscribe(b"").unwrap();
            sock.set_rcvhwm(0).unwrap();
            sock.connect(&format!("tcp://127.0.0.1:{}", args.shape().pub_port(s, r)))
                .unwrap();
            sock
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut gen = fleet.take_generator().unwrap();
    let sched = Schedule {
        start_ns: now_ns() + 50_000_000,
        phases: parse_rates("20000", 1.0).unwrap(),
        settle_s: 0.0,
    };
    let stop = AtomicBool::new(false);
    let outs = gen.run(&sched, None, &stop);
    assert_eq!(outs.len(), 1);
    let out = &outs[0];
    assert!(
        (15_000..=25_000).contains(&out.blocks_stored),
        "about the rate for a second: {out:?}"
    );
    assert_eq!(out.send_errors, 0);
    assert!(out.blocks_removed > 0, "300 blocks a rank fill up: {out:?}");

    // Every rank's batches arrive in sequence, decode as the gateway decodes them, with the
    // right rank and whole blocks of tokens.
    let mut received: Vec<Vec<(u64, Vec<u8>)>> = vec![Vec::new(); 8];
    let t = Instant::now();
    let mut total_batches = 0;
    while total_batches < out.batches && t.elapsed() < DEADLINE {
        for (i, s) in subs.iter().enumerate() {
            while let Ok(f) = s.recv_multipart(zmq::DONTWAIT) {
                assert_eq!(f.len(), 3, "topic, seq, payload");
                let seq = u64::from_be_bytes(f[1].as_slice().try_into().unwrap());
                received[i].push((seq, f[2].clone()));
                total_batches += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(total_batches, out.batches, "every batch arrived");
    for (i, batches) in received.iter().enumerate() {
        assert!(!batches.is_empty(), "rank {i} published");
        assert_eq!(
            batches[0].0, 1,
            "after the seed batch (0) the live stream starts at 1"
        );
        for (k, (seq, payload)) in batches.iter().enumerate() {
            assert_eq!(*seq, k as u64 + 1, "in sequence");
            let b = decode_batch(payload).expect("decodes");
            assert_eq!(b.dp_rank, Some(i as u32 % 2));
            assert!(b.ts.is_some());
            for e in b.events {
                if let KvEvent::BlockStored(s) = e {
                    assert_eq!(s.block_size, 16);
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * 16);
                }
            }
        }
    }

    // Replay from 0: the seed batch, then every live batch byte for byte, then the end.
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    dealer
        .connect(&format!(
            "tcp://127.0.0.1:{}",
            args.shape().replay_port(1, 1)
        ))
        .unwrap();
    dealer
        .send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
        .unwrap();
    let mut replayed = Vec::new();
    loop {
        let f = dealer.recv_multipart(0).expect("a replay answer");
        assert_eq!(f.len(), 4, "SGLang 0.5.23: empty, topic, seq, payload");
        if f[2] == (-1i64).to_be_bytes() {
            break;
        }
        replayed.push((
            u64::from_be_bytes(f[2].as_slice().try_into().unwrap()),
            f[3].clone(),
        ));
    }
    assert_eq!(replayed[0].0, 0, "the seed batch is replayed");
    assert_eq!(
        &replayed[1..],
        &received[3][..],
        "then the live batches, byte for byte"
    );
    drop(subs);
    drop(dealer);
    fleet.shutdown();
}
