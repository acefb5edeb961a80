use super::*;

#[test]
fn sequence_steps() {
    let mut t = SeqTracker::default();
    assert_eq!(t.step(7), SeqStep::First);
    t.accept(7);
    assert_eq!(t.step(8), SeqStep::Next);
    assert_eq!(t.step(11), SeqStep::Gap { from: 8, to: 11 });
    assert_eq!(t.step(7), SeqStep::Restart);
    assert_eq!(t.step(0), SeqStep::Restart);
    // Replayed ahead of the live queue: live 8..=10 are duplicates, 11 is next, and a
    // number at or below the last live one is still a restart.
    t.accept_replayed(8);
    t.accept_replayed(9);
    t.accept_replayed(10);
    assert_eq!(t.step(8), SeqStep::Duplicate);
    assert_eq!(t.step(10), SeqStep::Duplicate);
    assert_eq!(t.step(11), SeqStep::Next);
    assert_eq!(t.step(7), SeqStep::Restart);
    assert_eq!(t.step(0), SeqStep::Restart);
    t.accept(11);
    assert_eq!(t.step(10), SeqStep::Restart);
    t.accept(i64::MAX);
    assert_eq!(t.step(0), SeqStep::Restart);
    assert_eq!(t.last(), Some(i64::MAX));
}

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
    // Only resets for replaced or removed subscriptions were delivered, nothing else.
    assert!(rx.try_iter().all(|e| matches!(
        e,
        IntakeEvent::Reset {
            reason: ResetReason::Unsubscribed,
            ..
        }
    )));
}

#[test]
fn counts_start_at_zero_and_add_up() {
    let s = Stats::default();
    s.add(BATCH, 2);
    s.add(RESET, 1);
    s.add(GAP, 0);
    let c = s.counts();
    assert_eq!((c.batches, c.resets, c.gaps), (2, 1, 0));
}
