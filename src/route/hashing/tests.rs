use super::*;

fn board(n: u32) -> (Vec<WorkerId>, LoadBoard) {
    let b = LoadBoard::new(n as usize + 8);
    for w in 0..n {
        b.set_eligible(w, true);
    }
    ((0..n).collect(), b)
}

fn cell(ws: &[WorkerId]) -> RingCell {
    let c = RingCell::default();
    c.rebuild(ws);
    c
}

#[test]
fn hash_is_stable_and_sensitive() {
    assert_eq!(hash64(b"hello"), hash64(b"hello"));
    assert_ne!(hash64(b"hello"), hash64(b"hellp"));
    assert_ne!(hash64(b"a"), hash64(b"a\0"));
    assert_ne!(hash64(b""), hash64(b"\0"));
    let long = [7u8; 100];
    let mut long2 = long;
    long2[99] = 8;
    assert_ne!(hash64(&long), hash64(&long2));
    // Bits are balanced over many keys (each bit set ~half the time).
    let mut ones = [0u32; 64];
    for i in 0..4096u32 {
        let h = hash64(format!("user-{i}").as_bytes());
        for (b, o) in ones.iter_mut().enumerate() {
            *o += ((h >> b) & 1) as u32;
        }
    }
    assert!(ones.iter().all(|&o| (1800..2300).contains(&o)), "{ones:?}");
}

fn owners(c: &RingCell, b: &LoadBoard, keys: &[String]) -> Vec<WorkerId> {
    let ring = c.load();
    keys.iter()
        .map(|k| {
            ring.lookup(hash64(k.as_bytes()), |w| b.is_eligible(w))
                .unwrap()
        })
        .collect()
}

#[test]
fn ring_is_balanced() {
    let (ws, b) = board(10);
    let c = cell(&ws);
    assert_eq!(c.load().len(), 1500);
    let keys: Vec<String> = (0..100_000).map(|i| format!("session-{i}")).collect();
    let mut per = [0u32; 10];
    for w in owners(&c, &b, &keys) {
        per[w as usize] += 1;
    }
    assert!(per.iter().all(|&p| (7_000..13_000).contains(&p)), "{per:?}");
}

#[test]
fn adding_a_worker_moves_about_one_in_n_plus_one() {
    let (ws, b) = board(11);
    let keys: Vec<String> = (0..10_000).map(|i| format!("key-{i}")).collect();
    let before = owners(&cell(&ws[..10]), &b, &keys);
    let after = owners(&cell(&ws), &b, &keys);
    let moved: Vec<usize> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
    // Every moved key moved to the new worker, and about 1/11 of them moved.
    assert!(moved.iter().all(|&i| after[i] == 10));
    let frac = moved.len() as f64 / keys.len() as f64;
    assert!((0.06..0.125).contains(&frac), "moved {frac}");
    // An ineligible worker's keys go elsewhere; nobody else's key moves.
    b.set_eligible(3, false);
    let without = owners(&cell(&ws), &b, &keys);
    for i in 0..keys.len() {
        if after[i] == 3 {
            assert_ne!(without[i], 3);
        } else {
            assert_eq!(without[i], after[i]);
        }
    }
}

#[test]
fn target_worker_is_an_index_into_the_eligible_list() {
    let (ws, b) = board(4);
    let c = cell(&ws);
    let mut rng = Rng::with_seed(1);
    let mut input = RouteInput::new("", 0);
    input.target_worker = Some(b"1");
    let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::TargetWorker));
    b.set_eligible(0, false);
    let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (2, Branch::TargetWorker));
    // Out of range, garbage, or excluded → the key / random path.
    input.hash_key = Some(b"alice");
    for t in [&b"3"[..], b"99", b"-1", b"x", b"", b"1 2"] {
        input.target_worker = Some(t);
        let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::HashRing, "{:?}", t);
    }
    input.target_worker = Some(b" 0 ");
    let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::TargetWorker));
    let exclude = [1];
    input.exclude = &exclude;
    let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
    assert_eq!(d.branch, Branch::HashRing);
    assert_ne!(d.worker, 1);
}

#[test]
fn keyed_requests_stick_and_keyless_spread() {
    let (ws, b) = board(5);
    let c = cell(&ws);
    let mut rng = Rng::with_seed(2);
    let mut input = RouteInput::new("", 0);
    input.hash_key = Some(b"Bearer abc");
    let first = select_consistent(&c, &input, &ws, &b, &mut rng)
        .unwrap()
        .worker;
    for _ in 0..20 {
        let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (first, Branch::HashRing));
    }
    // Excluded on retry → the next worker clockwise, deterministically.
    let exclude = [first];
    input.exclude = &exclude;
    let second = select_consistent(&c, &input, &ws, &b, &mut rng)
        .unwrap()
        .worker;
    assert_ne!(second, first);
    assert_eq!(
        select_consistent(&c, &input, &ws, &b, &mut rng)
            .unwrap()
            .worker,
        second
    );
    let input = RouteInput::new("", 0);
    let mut seen = [0u32; 5];
    for _ in 0..500 {
        let d = select_consistent(&c, &input, &ws, &b, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::Random);
        seen[d.worker as usize] += 1;
    }
    assert!(seen.iter().all(|&s| s > 50), "{seen:?}");
}

#[test]
fn overload_bound_is_precise() {
    // Idle fleet: never overloaded, whatever its size.
    assert!(!overloaded(0, 0, 1));
    assert!(!overloaded(0, 0, 1000));
    // Two workers: 1 vs 0 is fine (4·1·2 = 8 ≤ 5·2 = 10); 2 vs 0 spills (16 > 15).
    assert!(!overloaded(1, 1, 2));
    assert!(overloaded(2, 2, 2));
    // Single worker: never overloaded (4·l ≤ 5·(l + 1)).
    assert!(!overloaded(1000, 1000, 1));
    // Even fleet of 8 at 10 each: the ring worker at 10 is fine; at 14 (sum 84) it spills
    // (4·14·8 = 448 > 5·85 = 425), at 13 (sum 83) not yet (416 ≤ 420).
    assert!(!overloaded(10, 80, 8));
    assert!(!overloaded(13, 83, 8));
    assert!(overloaded(14, 84, 8));
    // Four workers, one request on the ring worker, the rest idle: 16 > 10 → spills.
    assert!(overloaded(1, 1, 4));
}

#[test]
fn prefix_hash_sticks_then_spills_when_overloaded() {
    let (ws, b) = board(4);
    let c = cell(&ws);
    let mut rng = Rng::with_seed(3);
    let sys = "You are a helpful assistant. ".repeat(10);
    let t1 = format!("{sys}question one");
    let t2 = format!("{sys}another question");
    let i1 = RouteInput::new(&t1, 0);
    let i2 = RouteInput::new(&t2, 0);
    let d1 = select_prefix(&c, &i1, 64, &ws, &b, &mut rng).unwrap();
    let d2 = select_prefix(&c, &i2, 64, &ws, &b, &mut rng).unwrap();
    assert_eq!(d1.branch, Branch::HashRing);
    assert_eq!(d1.worker, d2.worker, "same first 64 chars, same worker");
    let w = d1.worker;
    // One request on the ring worker while three are idle: 4·1·4 = 16 > 5·2 = 10 → spill to
    // an idle worker.
    b.inc(w);
    let d = select_prefix(&c, &i1, 64, &ws, &b, &mut rng).unwrap();
    assert_eq!(d.branch, Branch::HashRingOverloaded);
    assert_ne!(d.worker, w);
    assert_eq!(b.load(d.worker), 0);
    // The rest catch up (all at 1, 16 ≤ 25): the ring worker is acceptable again.
    for o in ws.iter().copied().filter(|&o| o != w) {
        b.inc(o);
    }
    let d = select_prefix(&c, &i1, 64, &ws, &b, &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (w, Branch::HashRing));
    // One more on it (2 vs 1,1,1: 32 > 30) → spill again.
    b.inc(w);
    let d = select_prefix(&c, &i1, 64, &ws, &b, &mut rng).unwrap();
    assert_eq!(d.branch, Branch::HashRingOverloaded);
    assert_eq!(b.load(d.worker), 1);
}

#[test]
fn empty_ring_falls_back() {
    let (ws, b) = board(3);
    let c = RingCell::default();
    let mut rng = Rng::with_seed(4);
    let mut input = RouteInput::new("abc", 0);
    input.hash_key = Some(b"k");
    assert_eq!(
        select_consistent(&c, &input, &ws, &b, &mut rng)
            .unwrap()
            .branch,
        Branch::Random
    );
    assert_eq!(
        select_prefix(&c, &input, 8, &ws, &b, &mut rng)
            .unwrap()
            .branch,
        Branch::HashRingOverloaded
    );
}

#[test]
fn named_rings_place_keys_by_url_not_by_id_or_order() {
    let a = Ring::build_named(&[(0, b"http://a:1"), (1, b"http://b:1"), (2, b"http://c:1")]);
    // Another replica registered the same workers in another order, with other ids.
    let b = Ring::build_named(&[(7, b"http://c:1"), (5, b"http://a:1"), (6, b"http://b:1")]);
    let name_a = |w: WorkerId| ["http://a:1", "http://b:1", "http://c:1"][w as usize];
    let name_b = |w: WorkerId| match w {
        5 => "http://a:1",
        6 => "http://b:1",
        _ => "http://c:1",
    };
    for k in 0..2000u64 {
        let h = hash64(&k.to_le_bytes());
        let wa = a.lookup(h, |_| true).unwrap();
        let wb = b.lookup(h, |_| true).unwrap();
        assert_eq!(name_a(wa), name_b(wb));
    }
}
