use super::*;
use crate::kv::endpoint::TcpEndpoint;
use std::time::{Duration, Instant};

#[test]
fn a_flood_of_commands_never_blocks_the_caller() {
    let (tx, rx) = channel::unbounded();
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    let publisher = |worker| Publisher {
        key: PublisherKey { worker, dp_rank: 0 },
        live: TcpEndpoint::parse("tcp://127.0.0.1:9").unwrap(),
        replay: None,
    };
    let start = Instant::now();
    let (mut taken, mut busy) = (0, 0);
    for i in 0..20_000u32 {
        // The same few publishers again and again: the thread keeps at most 4 sockets.
        match intake.subscribe(publisher(i % 4)) {
            Ok(()) => taken += 1,
            Err(CommandError::Busy) => busy += 1,
            Err(CommandError::Stopped) => panic!("thread stopped"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(taken + busy, 20_000);
    assert!(taken >= COMMAND_QUEUE, "{taken}");
    intake.remove_worker(0).unwrap_or(());
    intake.stop();
    // Only resets for replaced or removed subscriptions and state reports were delivered.
    assert!(rx.try_iter().all(|e| matches!(
        e,
        IntakeEvent::Reset {
            reason: ResetReason::Unsubscribed,
            ..
        } | IntakeEvent::State { .. }
    )));
}

#[test]
fn counts_start_at_zero_and_add_up() {
    let s = Stats::default();
    s.add(BATCH, 2);
    s.add(RESET, 1);
    s.add(GAP, 0);
    s.add(CONNECT_FAILED, 3);
    let c = s.counts();
    assert_eq!((c.batches, c.resets, c.gaps), (2, 1, 0));
    assert_eq!(c.connect_failures, 3);
}
