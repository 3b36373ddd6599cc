//! The run slab's own tests: finding runs by their first key, splitting them either way,
//! forgetting their fronts, freeing and reusing slots, and the bound on their buffers.

use super::*;

/// Keys `from..to` of chain `salt` (a different chain, different keys).
fn keys(from: u64, to: u64, salt: u64) -> Vec<RouterKey> {
    (from..to)
        .map(|i| RouterKey(salt * 1_000_000 + i))
        .collect()
}

#[test]
fn a_run_is_found_by_its_first_key_with_the_blocks_a_chain_goes_through() {
    let mut slab = RunSlab::default();
    let id = slab.add(&keys(0, 6, 1), "a").unwrap();
    assert_eq!(slab.len(), 1);
    assert_eq!(slab.find(&keys(0, 6, 1)), Some((id, 6)));
    assert_eq!(slab.find(&keys(0, 3, 1)), Some((id, 3)), "a shorter chain");
    assert_eq!(slab.find(&keys(0, 9, 1)), Some((id, 6)), "a longer chain");
    // A chain that leaves the run after its third block.
    let leaves = [keys(0, 3, 1), keys(3, 8, 2)].concat();
    assert_eq!(slab.find(&leaves), Some((id, 3)));
    assert_eq!(slab.find(&keys(1, 6, 1)), None, "not a run's first key");
    assert_eq!(slab.find(&[]), None);
    assert_eq!(slab.get(id).info, "a");
    // A second run with the same first key (a collision) is refused.
    assert_eq!(slab.add(&keys(0, 2, 1), "b"), None);
    assert_eq!(slab.add(&[], "b"), None);
    assert_eq!(slab.len(), 1);
}

#[test]
fn splitting_the_front_off_leaves_the_id_with_the_rest() {
    let mut slab = RunSlab::default();
    let id = slab.add(&keys(0, 6, 1), 0).unwrap();
    let front = slab.split_front_off(id, 2, 1).unwrap();
    assert_eq!(slab.get(front).keys(), &keys(0, 2, 1)[..]);
    assert_eq!(slab.get(id).keys(), &keys(2, 6, 1)[..]);
    assert_eq!(slab.find(&keys(0, 6, 1)), Some((front, 2)));
    assert_eq!(slab.find(&keys(2, 6, 1)), Some((id, 4)));
    assert_eq!(slab.len(), 2);
    // Where the rest would start with another run's first key, nothing changes.
    let other = slab.add(&keys(4, 5, 1), 2).unwrap();
    assert_eq!(slab.split_front_off(id, 2, 3), None);
    assert_eq!(slab.get(id).keys(), &keys(2, 6, 1)[..]);
    assert_eq!(slab.find(&keys(4, 5, 1)), Some((other, 1)));
    assert_eq!(slab.len(), 3);
}

#[test]
fn splitting_the_back_off_leaves_the_id_with_the_front() {
    let mut slab = RunSlab::default();
    let id = slab.add(&keys(0, 6, 1), 0).unwrap();
    let back = slab.split_back_off(id, 2, 1).unwrap();
    assert_eq!(slab.get(id).keys(), &keys(0, 2, 1)[..]);
    assert_eq!(slab.get(back).keys(), &keys(2, 6, 1)[..]);
    assert_eq!(slab.find(&keys(0, 6, 1)), Some((id, 2)));
    assert_eq!(slab.find(&keys(2, 6, 1)), Some((back, 4)));
    let other = slab.add(&keys(3, 4, 1), 2).unwrap();
    assert_eq!(slab.split_back_off(back, 1, 3), None, "a collision");
    assert_eq!(slab.get(back).keys(), &keys(2, 6, 1)[..]);
    assert_eq!(slab.find(&keys(3, 4, 1)), Some((other, 1)));
}

#[test]
fn a_forgotten_front_moves_the_runs_first_key_and_buffers_stay_within_twice_their_keys() {
    let mut slab = RunSlab::default();
    let id = slab.add(&keys(0, 1000, 1), ()).unwrap();
    for forgotten in 1..1000 {
        slab.forget_front(id, 1);
        let run = slab.get(id);
        assert_eq!(run.keys(), &keys(forgotten, 1000, 1)[..]);
        assert!(
            run.keys.capacity() <= 2 * run.keys().len().max(2),
            "{} keys in a buffer of {}",
            run.keys().len(),
            run.keys.capacity()
        );
    }
    assert_eq!(slab.find(&keys(998, 1000, 1)), None, "forgotten");
    assert_eq!(slab.find(&keys(999, 1000, 1)), Some((id, 1)));
    // A long run split near its end: neither part keeps the whole allocation.
    let long = slab.add(&keys(0, 1000, 2), ()).unwrap();
    let front = slab.split_front_off(long, 990, ()).unwrap();
    let back = slab.split_back_off(front, 10, ()).unwrap();
    for id in [long, front, back] {
        let run = slab.get(id);
        assert!(
            run.keys.capacity() <= 2 * run.keys().len().max(2),
            "run {id}"
        );
    }
}

#[test]
fn a_freed_slot_is_reused_last_freed_first_without_its_buffer() {
    let mut slab = RunSlab::default();
    let a = slab.add(&keys(0, 500, 1), 'a').unwrap();
    let b = slab.add(&keys(0, 3, 2), 'b').unwrap();
    slab.free(a);
    assert!(!slab.get(a).is_live());
    assert_eq!(slab.get(a).keys.capacity(), 0, "the buffer is given back");
    assert_eq!(slab.find(&keys(0, 500, 1)), None);
    assert_eq!(slab.len(), 1);
    assert_eq!(slab.slots(), 2);
    // The first key is free again; the slot is reused.
    let c = slab.add(&keys(0, 2, 1), 'c').unwrap();
    assert_eq!(c, a);
    assert_eq!(slab.get(c).info, 'c');
    assert_eq!(slab.get(c).keys(), &keys(0, 2, 1)[..]);
    let mut seen = Vec::new();
    slab.for_each_live_mut(|run| seen.push(run.info));
    assert_eq!(seen, ['c', 'b']);
    assert!(slab.get(b).is_live());
    // Of two freed slots, the one freed last is reused first.
    slab.free(c);
    slab.free(b);
    assert_eq!(slab.add(&keys(0, 4, 3), 'd').unwrap(), b);
    assert_eq!(slab.add(&keys(0, 4, 4), 'e').unwrap(), a);
    assert_eq!(slab.slots(), 2, "no slot added while freed ones were left");
}

#[test]
fn chains_overlap_up_to_where_they_part() {
    let run = keys(0, 8, 1);
    for part in 1..8 {
        let chain = [keys(0, part, 1), keys(part, 12, 3)].concat();
        assert_eq!(chain_overlap(&chain, &run), part as usize);
    }
    assert_eq!(chain_overlap(&keys(0, 12, 1), &run), 8);
    assert_eq!(chain_overlap(&keys(0, 5, 1), &run), 5);
}
