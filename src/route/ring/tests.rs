use super::*;
use crate::workers::load::LoadBoard;

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
