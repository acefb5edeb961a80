use super::*;
use proptest::prelude::*;

fn w(ticket: u64, class: Priority, tenant: TenantId, tokens: u64) -> Waiter {
    Waiter {
        ticket,
        class,
        tenant,
        tokens,
        requests: 1,
    }
}

/// Pop everything, charging as the admission does; the tickets in the order let in.
fn drain(q: &mut WaitQueue, f: &mut Fairness) -> Vec<u64> {
    let mut out = Vec::new();
    while let Some(x) = q.pop(f) {
        f.charge(x.tenant, x.tokens);
        out.push(x.ticket);
    }
    out
}

#[test]
fn higher_classes_go_first_and_arrival_orders_a_tenants_line() {
    let mut f = Fairness::new([1.0]);
    let mut q = WaitQueue::new(10);
    for (t, class) in [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1)] {
        assert_eq!(q.push(w(t, class, 0, 10), &mut f), Pushed::Queued);
    }
    assert_eq!(q.ahead_of(5), 2);
    assert_eq!(q.ahead_of(0), 4);
    assert!(q.would_lead(6));
    assert_eq!(
        q.depths().collect::<Vec<_>>(),
        vec![(5, 2), (0, 2), (-1, 1)]
    );
    assert_eq!(drain(&mut q, &mut f), vec![2, 4, 1, 3, 5]);
    assert!(q.is_empty());
}

#[test]
fn within_a_class_tokens_decide_not_requests() {
    // Tenant 0 sends long prompts, tenant 1 short ones, both backlogged in one class: tenant 1
    // gets ten requests in for each of tenant 0's, so both are served the same tokens.
    let mut f = Fairness::new([1.0, 1.0]);
    let mut q = WaitQueue::new(1000);
    let mut ticket = 0;
    for _ in 0..10 {
        ticket += 1;
        q.push(w(ticket, 0, 0, 1000), &mut f);
    }
    for _ in 0..100 {
        ticket += 1;
        q.push(w(ticket, 0, 1, 100), &mut f);
    }
    let mut served = [0u64; 2];
    let mut count = [0u32; 2];
    for _ in 0..55 {
        let x = q.pop(&f).expect("a waiter");
        f.charge(x.tenant, x.tokens);
        served[x.tenant as usize] += x.tokens;
        count[x.tenant as usize] += 1;
    }
    assert_eq!(count, [5, 50], "{served:?}");
    assert!(served[0].abs_diff(served[1]) <= 1000, "{served:?}");
}

#[test]
fn a_heavier_weight_gets_a_larger_share() {
    let mut f = Fairness::new([1.0, 3.0]);
    let mut q = WaitQueue::new(1000);
    for t in 0..400 {
        q.push(w(t, 0, (t % 2) as TenantId, 100), &mut f);
    }
    let mut count = [0u32; 2];
    for _ in 0..200 {
        let x = q.pop(&f).expect("a waiter");
        f.charge(x.tenant, x.tokens);
        count[x.tenant as usize] += 1;
    }
    assert_eq!(count, [50, 150]);
}

#[test]
fn a_tenant_back_from_idle_does_not_take_the_room_with_saved_credit() {
    let mut f = Fairness::new([1.0, 1.0]);
    let mut q = WaitQueue::new(1000);
    // Tenant 0 alone for a long time.
    for t in 0..50 {
        q.push(w(t, 0, 0, 100), &mut f);
    }
    for _ in 0..40 {
        let x = q.pop(&f).unwrap();
        f.charge(x.tenant, x.tokens);
    }
    // Tenant 1 arrives with 20 waiters: it alternates with tenant 0 instead of going 40 times
    // in a row.
    for t in 100..120 {
        q.push(w(t, 0, 1, 100), &mut f);
    }
    let order: Vec<TenantId> = (0..10)
        .map(|_| {
            let x = q.pop(&f).unwrap();
            f.charge(x.tenant, x.tokens);
            x.tenant
        })
        .collect();
    let zeros = order.iter().filter(|t| **t == 0).count();
    assert!((4..=6).contains(&zeros), "{order:?}");
}

#[test]
fn a_full_room_sheds_the_newest_of_the_lowest_class_below_the_newcomer() {
    let mut f = Fairness::new([1.0, 1.0]);
    let mut q = WaitQueue::new(3);
    q.push(w(1, -1, 0, 1), &mut f);
    q.push(w(2, -1, 1, 1), &mut f);
    q.push(w(3, 0, 0, 1), &mut f);
    // Same class as the lowest waiting: refused.
    assert_eq!(q.push(w(4, -1, 0, 1), &mut f), Pushed::Refused);
    // Higher: the newest of class -1 (ticket 2) goes.
    assert_eq!(
        q.push(w(5, 0, 1, 1), &mut f),
        Pushed::QueuedShedding(w(2, -1, 1, 1))
    );
    assert_eq!(q.len(), 3);
    assert_eq!(
        q.push(w(6, 9, 1, 1), &mut f),
        Pushed::QueuedShedding(w(1, -1, 0, 1))
    );
    // Now the lowest class is 0 and a class-0 newcomer is refused.
    assert_eq!(q.push(w(7, 0, 1, 1), &mut f), Pushed::Refused);
    assert_eq!(drain(&mut q, &mut f), vec![6, 3, 5]);
    assert_eq!(
        WaitQueue::new(0).push(w(1, 99, 0, 1), &mut f),
        Pushed::Refused
    );
}

#[test]
fn a_waiter_that_leaves_is_taken_out_wherever_it_waits() {
    let mut f = Fairness::new([1.0, 1.0]);
    let mut q = WaitQueue::new(10);
    for t in 1..=6 {
        q.push(w(t, (t % 3) as Priority, (t % 2) as TenantId, 1), &mut f);
    }
    assert_eq!(q.remove(4).map(|x| x.ticket), Some(4));
    assert_eq!(q.remove(4), None, "gone already");
    assert_eq!(q.remove(99), None);
    assert_eq!(q.len(), 5);
    let mut rest = drain(&mut q, &mut f);
    rest.sort_unstable();
    assert_eq!(rest, vec![1, 2, 3, 5, 6]);
}

#[derive(Debug, Clone)]
enum Op {
    Push { class: i8, tenant: u8, tokens: u16 },
    Pop,
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (-2i8..3, 0u8..4, 1u16..2000).prop_map(|(class, tenant, tokens)| Op::Push { class, tenant, tokens }),
        2 => Just(Op::Pop),
        1 => any::<u8>().prop_map(Op::Remove),
    ]
}

proptest! {
    /// Against a plain list: the room never holds more than its capacity, every waiter comes
    /// out exactly once (let in, shed, removed or still there), a pop always takes a waiter of
    /// the highest class present, and within that class one of the least-served tenants.
    #[test]
    fn the_room_keeps_every_waiter_once_and_serves_the_highest_class_first(
        cap in 0usize..12,
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let mut f = Fairness::new([1.0, 2.0, 1.0, 0.5]);
        let mut q = WaitQueue::new(cap);
        let mut model: Vec<Waiter> = Vec::new();
        let mut ticket = 0u64;
        for o in ops {
            match o {
                Op::Push { class, tenant, tokens } => {
                    ticket += 1;
                    let x = w(ticket, class.into(), tenant.into(), tokens.into());
                    match q.push(x, &mut f) {
                        Pushed::Queued => model.push(x),
                        Pushed::QueuedShedding(s) => {
                            let low = model.iter().map(|m| m.class).min().unwrap();
                            prop_assert_eq!(s.class, low);
                            prop_assert!(s.class < x.class);
                            let newest = model.iter().filter(|m| m.class == low).map(|m| m.ticket).max();
                            prop_assert_eq!(Some(s.ticket), newest);
                            model.retain(|m| m.ticket != s.ticket);
                            model.push(x);
                        }
                        Pushed::Refused => {
                            prop_assert_eq!(model.len(), cap);
                            prop_assert!(model.iter().all(|m| m.class >= x.class));
                        }
                    }
                }
                Op::Pop => match q.pop(&f) {
                    None => prop_assert!(model.is_empty()),
                    Some(x) => {
                        let top = model.iter().map(|m| m.class).max().unwrap();
                        prop_assert_eq!(x.class, top);
                        let least = model
                            .iter()
                            .filter(|m| m.class == top)
                            .map(|m| f.counter(m.tenant))
                            .fold(f64::INFINITY, f64::min);
                        prop_assert_eq!(f.counter(x.tenant), least);
                        let first_of_tenant = model
                            .iter()
                            .filter(|m| m.class == top && m.tenant == x.tenant)
                            .map(|m| m.ticket)
                            .min();
                        prop_assert_eq!(Some(x.ticket), first_of_tenant);
                        f.charge(x.tenant, x.tokens);
                        model.retain(|m| m.ticket != x.ticket);
                    }
                },
                Op::Remove(t) => {
                    let t = u64::from(t) % (ticket + 1);
                    let had = model.iter().any(|m| m.ticket == t);
                    prop_assert_eq!(q.remove(t).is_some(), had);
                    model.retain(|m| m.ticket != t);
                }
            }
            prop_assert!(q.len() <= cap);
            prop_assert_eq!(q.len(), model.len());
            prop_assert_eq!(q.ahead_of(i32::MIN), model.len());
        }
    }
}
