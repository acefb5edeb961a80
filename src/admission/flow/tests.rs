use super::*;
use crate::admission::tenants::{TenantSpec, Tenants};
use std::cell::Cell;
use std::rc::Rc;

/// A fleet whose free workers the test sets: `free` for every class, plus `headroom` more for
/// classes above 0 (the KV kept for them).
#[derive(Default)]
struct TestFleet {
    free: Cell<usize>,
    headroom: Cell<usize>,
}

impl Fleet for TestFleet {
    fn room_for(&self, _room: RoomKey, class: Priority) -> usize {
        self.free.get() + if class > 0 { self.headroom.get() } else { 0 }
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
        .enable_timer()
        .build()
        .expect("runtime")
        .block_on(f)
}

fn tenants(specs: &[(&str, TenantSpec)]) -> Tenants {
    let v: Vec<(String, TenantSpec)> = specs
        .iter()
        .map(|(n, s)| (n.to_string(), s.clone()))
        .collect();
    Tenants::new(&v).unwrap()
}

fn flow(queue_size: usize, timeout_ms: u64) -> Flow {
    Flow::new(
        FlowConfig {
            queue_size,
            queue_timeout: Duration::from_millis(timeout_ms),
            sheddable_wait: Duration::from_secs(1),
        },
        tenants(&[]),
    )
}

fn ask(class: Priority, tenant: TenantId) -> Ask {
    Ask {
        room: 7,
        class,
        tenant,
        tokens: 100,
        requests: 1,
    }
}

fn never() -> std::future::Pending<()> {
    std::future::pending()
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if f() {
            return;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{what} never happened");
}

#[test]
fn an_unsaturated_fleet_lets_requests_straight_through() {
    let f = flow(10, 1000);
    let fleet = TestFleet::default();
    fleet.free.set(1);
    block_on(async {
        for _ in 0..100 {
            assert_eq!(
                f.admit(ask(0, 0), &fleet, never()).await,
                Ok(Admitted::Direct)
            );
        }
    });
    assert_eq!(f.waiting(), 0);
}

#[test]
fn a_saturated_fleet_queues_and_lets_the_highest_class_in_first() {
    let f = Rc::new(flow(10, 5000));
    let fleet = Rc::new(TestFleet::default());
    let order = Rc::new(std::cell::RefCell::new(Vec::new()));
    block_on(async {
        let mut tasks = Vec::new();
        for (i, class) in [(0, 0), (1, 5), (2, -1), (3, 5), (4, 0)] {
            let (f2, fleet2, order) = (f.clone(), fleet.clone(), order.clone());
            tasks.push(monoio::spawn(async move {
                let r = f2.admit(ask(class, 0), &*fleet2, never()).await;
                // Routed: the worker it went to has one request more (as routing does).
                fleet2.free.set(fleet2.free.get().saturating_sub(1));
                assert!(matches!(r, Ok(Admitted::Waited(_))), "{r:?}");
                order.borrow_mut().push(i);
            }));
            // Arrival order is the order of the loop.
            until("queued", || f.waiting() == i + 1).await;
        }
        // One worker frees up at a time; each time exactly one waiter goes.
        for n in 1..=5 {
            fleet.free.set(1);
            until("one let in", || order.borrow().len() == n).await;
            monoio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(order.borrow().len(), n, "no more than the room there was");
        }
        for t in tasks {
            t.await;
        }
    });
    assert_eq!(*order.borrow(), vec![1, 3, 0, 4, 2]);
    assert_eq!(f.waiting(), 0);
}

#[test]
fn a_newcomer_does_not_jump_waiters_of_its_class_but_does_jump_lower_ones() {
    let f = Rc::new(flow(10, 5000));
    let fleet = Rc::new(TestFleet::default());
    block_on(async {
        let (f2, fl2) = (f.clone(), fleet.clone());
        let low = monoio::spawn(async move { f2.admit(ask(0, 0), &*fl2, never()).await });
        until("queued", || f.waiting() == 1).await;
        fleet.free.set(1);
        // Same class: behind the waiter, so it waits (and the waiter goes first).
        let same = f.admit(ask(0, 0), &*fleet, never());
        let r = same.await;
        assert!(matches!(r, Ok(Admitted::Waited(_))), "{r:?}");
        assert!(matches!(low.await, Ok(Admitted::Waited(_))));
        // A higher class with nobody of its class waiting goes straight through even while a
        // lower class waits.
        fleet.free.set(0);
        let (f3, fl3) = (f.clone(), fleet.clone());
        let low = monoio::spawn(async move { f3.admit(ask(0, 0), &*fl3, never()).await });
        until("queued", || f.waiting() == 1).await;
        fleet.free.set(1);
        assert_eq!(
            f.admit(ask(3, 0), &*fleet, never()).await,
            Ok(Admitted::Direct)
        );
        assert!(matches!(low.await, Ok(Admitted::Waited(_))));
    });
}

#[test]
fn a_full_queue_refuses_its_lowest_class_and_sheds_a_lower_waiter_for_a_higher_one() {
    let f = Rc::new(flow(2, 5000));
    let fleet = Rc::new(TestFleet::default());
    block_on(async {
        let mut low = Vec::new();
        for _ in 0..2 {
            let (f2, fl2) = (f.clone(), fleet.clone());
            low.push(monoio::spawn(async move {
                f2.admit(ask(0, 0), &*fl2, never()).await
            }));
            until("queued", || f.waiting() == low.len()).await;
        }
        let r = f.admit(ask(0, 0), &*fleet, never()).await;
        assert!(
            matches!(r, Err(Denied::Full { retry_after }) if retry_after >= 1),
            "{r:?}"
        );
        // A higher class takes the place of the newest low waiter, which is shed.
        let (f2, fl2) = (f.clone(), fleet.clone());
        let high = monoio::spawn(async move { f2.admit(ask(9, 0), &*fl2, never()).await });
        let second = low.pop().unwrap().await;
        assert!(
            matches!(second, Err(Denied::Shed { retry_after }) if retry_after >= 1),
            "{second:?}"
        );
        assert_eq!(f.waiting(), 2);
        fleet.free.set(1);
        assert!(matches!(high.await, Ok(Admitted::Waited(_))));
        assert!(matches!(low.pop().unwrap().await, Ok(Admitted::Waited(_))));
    });
}

#[test]
fn a_waiter_times_out_and_leaves_the_room() {
    let f = flow(10, 30);
    let fleet = TestFleet::default();
    block_on(async {
        let t0 = Instant::now();
        assert_eq!(
            f.admit(ask(0, 0), &fleet, never()).await,
            Err(Denied::Timeout)
        );
        assert!(t0.elapsed() >= Duration::from_millis(30));
    });
    assert_eq!(f.waiting(), 0);
}

#[test]
fn a_client_that_leaves_while_queued_frees_its_place_and_is_never_let_in() {
    let f = Rc::new(flow(10, 5000));
    let fleet = Rc::new(TestFleet::default());
    block_on(async {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let gone = async move {
            while rx.try_recv().is_err() {
                monoio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let (f2, fl2) = (f.clone(), fleet.clone());
        let leaving = monoio::spawn(async move { f2.admit(ask(5, 0), &*fl2, gone).await });
        let (f3, fl3) = (f.clone(), fleet.clone());
        let stays = monoio::spawn(async move { f3.admit(ask(0, 0), &*fl3, never()).await });
        until("both queued", || f.waiting() == 2).await;
        tx.send(()).unwrap();
        assert_eq!(leaving.await, Err(Denied::ClientGone));
        assert_eq!(f.waiting(), 1);
        fleet.free.set(1);
        assert!(matches!(stays.await, Ok(Admitted::Waited(_))));
    });
    assert_eq!(f.waiting(), 0);
}

#[test]
fn a_dropped_wait_takes_the_waiter_out() {
    let f = flow(10, 5000);
    let fleet = TestFleet::default();
    block_on(async {
        let r = monoio::time::timeout(
            Duration::from_millis(20),
            f.admit(ask(0, 0), &fleet, never()),
        )
        .await;
        assert!(r.is_err(), "still waiting when dropped");
    });
    assert_eq!(f.waiting(), 0);
}

#[test]
fn tenant_limits_refuse_with_the_time_until_there_is_room() {
    let f = Flow::new(
        FlowConfig {
            queue_size: 10,
            queue_timeout: Duration::from_secs(1),
            sheddable_wait: Duration::from_secs(1),
        },
        tenants(&[
            (
                "few",
                TenantSpec {
                    keys: vec!["k1".into()],
                    requests_per_minute: Some(2),
                    ..TenantSpec::default()
                },
            ),
            (
                "small",
                TenantSpec {
                    keys: vec!["k2".into()],
                    tokens_per_minute: Some(250),
                    ..TenantSpec::default()
                },
            ),
        ]),
    );
    let few = f.tenants().by_key("k1");
    let small = f.tenants().by_key("k2");
    let fleet = TestFleet::default();
    fleet.free.set(4);
    block_on(async {
        for _ in 0..2 {
            assert!(f.admit(ask(0, few), &fleet, never()).await.is_ok());
        }
        // Two a minute: the next one has room in 30 s.
        match f.admit(ask(0, few), &fleet, never()).await {
            Err(Denied::TenantLimit { retry_after }) => {
                assert!((29..=31).contains(&retry_after), "{retry_after}")
            }
            r => panic!("{r:?}"),
        }
        // 250 tokens a minute, 100 a request: two go, and output tokens count too.
        assert!(f.admit(ask(0, small), &fleet, never()).await.is_ok());
        f.charge_output(small, 100);
        assert!(matches!(
            f.admit(ask(0, small), &fleet, never()).await,
            Err(Denied::TenantLimit { .. })
        ));
        // Another tenant is not limited by them.
        assert!(f.admit(ask(0, 0), &fleet, never()).await.is_ok());
    });
}

#[test]
fn a_sheddable_request_is_refused_when_the_expected_wait_passes_its_bound() {
    let f = Rc::new(Flow::new(
        FlowConfig {
            queue_size: 100,
            queue_timeout: Duration::from_secs(5),
            sheddable_wait: Duration::from_millis(500),
        },
        tenants(&[]),
    ));
    let fleet = Rc::new(TestFleet::default());
    block_on(async {
        // No drain measured yet: a sheddable request waits like any other.
        let (f2, fl2) = (f.clone(), fleet.clone());
        let first = monoio::spawn(async move { f2.admit(ask(-1, 0), &*fl2, never()).await });
        until("queued", || f.waiting() == 1).await;
        fleet.free.set(1);
        assert!(matches!(first.await, Ok(Admitted::Waited(_))));
        fleet.free.set(0);
        // One grant in the last 10 s: 0.1 a second. Ten waiters ahead: ~100 s expected.
        let mut queued = Vec::new();
        for i in 0..10 {
            let (f2, fl2) = (f.clone(), fleet.clone());
            queued.push(monoio::spawn(async move {
                f2.admit(ask(0, 0), &*fl2, never()).await
            }));
            until("queued", || f.waiting() == i + 1).await;
        }
        match f.admit(ask(-1, 0), &*fleet, never()).await {
            Err(Denied::Overloaded { retry_after }) => assert!(retry_after >= 50, "{retry_after}"),
            r => panic!("{r:?}"),
        }
        // A class that is not sheddable still waits.
        let (f2, fl2) = (f.clone(), fleet.clone());
        let patient = monoio::spawn(async move { f2.admit(ask(0, 0), &*fl2, never()).await });
        until("queued", || f.waiting() == 11).await;
        fleet.free.set(3);
        for q in queued {
            let r = q.await;
            assert!(r.is_ok(), "{r:?}");
        }
        let r = patient.await;
        assert!(r.is_ok(), "{r:?}");
    });
}

#[test]
fn headroom_lets_a_prioritized_class_in_while_the_others_wait() {
    let f = Rc::new(flow(10, 5000));
    let fleet = Rc::new(TestFleet::default());
    fleet.headroom.set(1);
    block_on(async {
        // Saturated for class 0: it waits.
        let (f2, fl2) = (f.clone(), fleet.clone());
        let low = monoio::spawn(async move { f2.admit(ask(0, 0), &*fl2, never()).await });
        until("queued", || f.waiting() == 1).await;
        // Class 5 goes straight onto the headroom.
        assert_eq!(
            f.admit(ask(5, 0), &*fleet, never()).await,
            Ok(Admitted::Direct)
        );
        // A class-5 waiter behind a saturated headroom goes first once there is room for it,
        // while class 0 still has none.
        fleet.headroom.set(0);
        let (f3, fl3) = (f.clone(), fleet.clone());
        let high = monoio::spawn(async move { f3.admit(ask(5, 0), &*fl3, never()).await });
        until("both queued", || f.waiting() == 2).await;
        fleet.headroom.set(1);
        assert!(matches!(high.await, Ok(Admitted::Waited(_))));
        monoio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(f.waiting(), 1, "class 0 still waits: no room for it");
        fleet.free.set(1);
        assert!(matches!(low.await, Ok(Admitted::Waited(_))));
    });
}

fn limited(requests: Option<u32>, tokens: Option<u64>) -> Flow {
    Flow::new(
        FlowConfig {
            queue_size: 10,
            queue_timeout: Duration::from_secs(1),
            sheddable_wait: Duration::from_secs(1),
        },
        tenants(&[(
            "t",
            TenantSpec {
                keys: vec!["k".into()],
                requests_per_minute: requests,
                tokens_per_minute: tokens,
                ..TenantSpec::default()
            },
        )]),
    )
}

#[test]
fn a_batch_is_charged_every_generation_it_asks_for() {
    let f = limited(Some(10), None);
    let t = f.tenants().by_key("k");
    let fleet = TestFleet::default();
    fleet.free.set(4);
    let batch = |requests| Ask {
        requests,
        ..ask(0, t)
    };
    block_on(async {
        assert!(f.admit(batch(6), &fleet, never()).await.is_ok());
        // 4 left: a batch of 5 waits for room (6 s of refill at 10 a minute), one of 4 fits.
        match f.admit(batch(5), &fleet, never()).await {
            Err(Denied::TenantLimit { retry_after }) => {
                assert!((5..=7).contains(&retry_after), "{retry_after}")
            }
            r => panic!("{r:?}"),
        }
        assert!(f.admit(batch(4), &fleet, never()).await.is_ok());
    });
}

#[test]
fn a_request_over_the_whole_limit_is_refused_at_once_not_let_through_or_told_to_wait_forever() {
    let fleet = TestFleet::default();
    fleet.free.set(4);
    block_on(async {
        // More generations than a minute allows, on a fresh limit.
        let f = limited(Some(2), None);
        let t = f.tenants().by_key("k");
        let r = f
            .admit(
                Ask {
                    requests: 501,
                    ..ask(0, t)
                },
                &fleet,
                never(),
            )
            .await;
        assert_eq!(r, Err(Denied::OverTenantLimit));
        // Nothing was charged: a request that fits still goes.
        assert!(f.admit(ask(0, t), &fleet, never()).await.is_ok());
        // More tokens than a minute allows.
        let f = limited(None, Some(50_000));
        let t = f.tenants().by_key("k");
        let r = f
            .admit(
                Ask {
                    tokens: 191_875,
                    ..ask(0, t)
                },
                &fleet,
                never(),
            )
            .await;
        assert_eq!(r, Err(Denied::OverTenantLimit));
        // A limit of 0 allows nothing, from the first request on.
        for f in [limited(Some(0), None), limited(None, Some(0))] {
            let t = f.tenants().by_key("k");
            for _ in 0..2 {
                assert_eq!(
                    f.admit(ask(0, t), &fleet, never()).await,
                    Err(Denied::OverTenantLimit)
                );
            }
        }
    });
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn thousands_of_waiters_cost_next_to_no_cpu_while_they_wait() {
    const WAITERS: usize = 3000;
    let f = Rc::new(flow(WAITERS, 60_000));
    let fleet = Rc::new(TestFleet::default());
    block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..WAITERS {
            let (f2, fl2) = (f.clone(), fleet.clone());
            tasks.push(monoio::spawn(async move {
                f2.admit(ask(0, 0), &*fl2, never()).await
            }));
        }
        until("all queued", || f.waiting() == WAITERS).await;
        // Let the spawning settle, then measure a second of pure waiting.
        monoio::time::sleep(Duration::from_millis(50)).await;
        let (cpu0, wall0) = (thread_cpu(), Instant::now());
        monoio::time::sleep(Duration::from_secs(1)).await;
        let (cpu, wall) = (thread_cpu() - cpu0, wall0.elapsed());
        let share = cpu.as_secs_f64() / wall.as_secs_f64();
        eprintln!("{WAITERS} waiters: {:.1} % of a core", share * 100.0);
        assert!(
            share < 0.2,
            "{WAITERS} waiters used {:.0} % of a core",
            share * 100.0
        );
        // And they are still let in, in order, once there is room.
        fleet.free.set(WAITERS);
        for t in tasks {
            assert!(matches!(t.await, Ok(Admitted::Waited(_))));
        }
    });
    assert_eq!(f.waiting(), 0);
}
