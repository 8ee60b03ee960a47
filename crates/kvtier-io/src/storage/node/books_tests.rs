//! Tests of the node's books (`books.rs`): visibility, eviction, shares, namespaces, damage,
//! byte-range reuse across block sizes, and the slot property test.
#![allow(clippy::unwrap_used)]
use super::*;
use proptest::prelude::*;

fn put(b: &mut Books, c: ClientId, key: u128, bytes: u64) -> Result<u64, PutRefused> {
    let g = b.begin_put(c, key, bytes)?;
    assert!(b.commit_put(c, g.id, Some(key as u64)));
    Ok(g.offset)
}

#[test]
fn a_block_is_invisible_until_committed_and_an_abandoned_write_frees_its_slot() {
    let mut b = Books::new(4 * 100);
    let w = b.attach(0, "m").unwrap();
    let r = b.attach(0, "m").unwrap();
    let g = b.begin_put(w, 7, 100).unwrap();
    assert_eq!(b.contains(r, &[7]), vec![false]);
    assert!(b.begin_get(r, 7).is_none());
    assert_eq!(b.begin_put(r, 7, 100), Err(PutRefused::Present));
    b.detach(w); // the writer crashed mid-write
    assert_eq!(b.contains(r, &[7]), vec![false]);
    assert_eq!(b.stats().abandoned_puts, 1);
    // Its slot is reused, not leaked.
    assert_eq!(put(&mut b, r, 7, 100), Ok(g.offset));
    assert!(
        !b.commit_put(w, g.id, None),
        "a detached client commits nothing"
    );
}

#[test]
fn namespaces_never_see_each_other() {
    let mut b = Books::new(1000);
    let a = b.attach(0, "model-a").unwrap();
    let q = b.attach(0, "model-b").unwrap();
    put(&mut b, a, 1, 10).unwrap();
    assert_eq!(b.contains(q, &[1]), vec![false]);
    assert!(b.begin_get(q, 1).is_none());
    let a2 = b.attach(0, "model-a").unwrap();
    assert_eq!(b.contains(a2, &[1]), vec![true]);
}

#[test]
fn leased_blocks_are_not_evicted_and_a_full_node_refuses() {
    let mut b = Books::new(2 * 10);
    let c = b.attach(0, "m").unwrap();
    put(&mut b, c, 1, 10).unwrap();
    put(&mut b, c, 2, 10).unwrap();
    let l1 = b.begin_get(c, 1).unwrap();
    let l2 = b.begin_get(c, 2).unwrap();
    assert_eq!(b.begin_put(c, 3, 10), Err(PutRefused::Full));
    b.end_get(c, l1.id);
    assert!(put(&mut b, c, 3, 10).is_ok(), "1 is unleased now");
    assert_eq!(b.contains(c, &[1, 2, 3]), vec![false, true, true]);
    b.detach(c); // leases end with the client
    let d = b.attach(0, "m").unwrap();
    assert!(put(&mut b, d, 4, 10).is_ok());
    let _ = l2;
}

#[test]
fn one_engine_filling_the_node_cannot_push_another_below_its_share() {
    let mut b = Books::new(10 * 10);
    let a = b.attach(0, "a").unwrap();
    let q = b.attach(0, "b").unwrap();
    for k in 0..3 {
        put(&mut b, q, 1000 + k, 10).unwrap();
    }
    for k in 0..50 {
        put(&mut b, a, k, 10).unwrap();
    }
    // b holds 30 of its 50-byte share: all of its blocks survive a's flood.
    assert_eq!(b.contains(q, &[1000, 1001, 1002]), vec![true; 3]);
    assert!(b.stats().evictions > 0);
}

#[test]
fn weighted_shares_protect_the_heavier_namespace() {
    // 10 slots; a weighs 3, b 1: a's share is 7.5 slots, b's 2.5.
    let p = SharePolicy::parse("weighted:a=3").unwrap();
    let mut b = Books::with_policy(10 * 10, p);
    let a = b.attach(0, "a-0000000000000000").unwrap();
    let q = b.attach(0, "b-0000000000000000").unwrap();
    for k in 0..7 {
        put(&mut b, a, k, 10).unwrap();
    }
    for k in 0..50 {
        put(&mut b, q, 1000 + k, 10).unwrap();
    }
    // b's flood never takes a's 7 slots (below its share), only its own.
    assert_eq!(b.contains(a, &[0, 1, 2, 3, 4, 5, 6]), vec![true; 7]);
    assert_eq!(
        b.stats().puts_full,
        0,
        "a full node evicts, it does not refuse"
    );
    // With equal weights a's 7 slots are above its share of 5: b's flood takes 2 of them.
    let mut e = Books::new(10 * 10);
    let a = e.attach(0, "a-0000000000000000").unwrap();
    let q = e.attach(0, "b-0000000000000000").unwrap();
    for k in 0..7 {
        put(&mut e, a, k, 10).unwrap();
    }
    for k in 0..50 {
        put(&mut e, q, 1000 + k, 10).unwrap();
    }
    let kept = e
        .contains(a, &[0, 1, 2, 3, 4, 5, 6])
        .iter()
        .filter(|x| **x)
        .count();
    assert_eq!(kept, 5, "equal shares: a keeps exactly its share");
}

#[derive(Clone, Debug)]
enum Op {
    Attach(u8),
    Detach(u8),
    BeginPut(u8, u8, u8),
    Commit(u8),
    Abort(u8),
    Get(u8, u8),
    EndGet(u8),
    Grant(u8, u8),
    Name(u8, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..2).prop_map(Op::Attach),
        (0u8..4).prop_map(Op::Detach),
        (0u8..4, 0u8..6, 1u8..3).prop_map(|(c, k, s)| Op::BeginPut(c, k, s)),
        (0u8..8).prop_map(Op::Commit),
        (0u8..8).prop_map(Op::Abort),
        (0u8..4, 0u8..6).prop_map(|(c, k)| Op::Get(c, k)),
        (0u8..8).prop_map(Op::EndGet),
        (0u8..4, 1u8..3).prop_map(|(c, s)| Op::Grant(c, s)),
        (0u8..8, 0u8..6).prop_map(|(g, k)| Op::Name(g, k)),
    ]
}

proptest! {
    /// Slots never overlap among live blocks, reservations and leases; leased blocks stay;
    /// nothing exceeds the arena.
    #[test]
    fn slots_never_overlap_and_leases_pin(ops in proptest::collection::vec(op(), 1..200)) {
        let mut b = Books::new(128);
        let mut clients: Vec<ClientId> = Vec::new();
        let mut puts: Vec<(ClientId, u64)> = Vec::new();
        let mut grants: Vec<(ClientId, u64)> = Vec::new();
        let mut leases: Vec<(ClientId, u64, u128)> = Vec::new();
        for o in ops {
            match o {
                Op::Attach(ns) => clients.push(b.attach(0, if ns == 0 { "a" } else { "b" }).unwrap()),
                Op::Detach(i) => if let Some(&c) = clients.get(i as usize) {
                    b.detach(c);
                    clients.retain(|x| *x != c);
                    leases.retain(|l| l.0 != c);
                    grants.retain(|g| g.0 != c);
                },
                Op::BeginPut(i, k, s) => if let Some(&c) = clients.get(i as usize) {
                    if let Ok(g) = b.begin_put(c, k as u128, 8 * s as u64) { puts.push((c, g.id)); }
                },
                Op::Commit(i) => if !puts.is_empty() {
                    let (c, id) = puts.remove(i as usize % puts.len());
                    b.commit_put(c, id, None);
                },
                Op::Abort(i) => if !puts.is_empty() {
                    let (c, id) = puts.remove(i as usize % puts.len());
                    b.abort_put(c, id);
                },
                Op::Get(i, k) => if let Some(&c) = clients.get(i as usize) {
                    if let Some(g) = b.begin_get(c, k as u128) { leases.push((c, g.id, k as u128)); }
                },
                Op::EndGet(i) => if !leases.is_empty() {
                    let (c, id, _) = leases.remove(i as usize % leases.len());
                    b.end_get(c, id);
                },
                Op::Grant(i, s) => if let Some(&c) = clients.get(i as usize) {
                    if let Ok(g) = b.grant(c, 8 * s as u64) {
                        prop_assert!(!b.commit_put(c, g.id, None), "an unnamed grant committed");
                        grants.push((c, g.id));
                    }
                },
                Op::Name(i, k) => if !grants.is_empty() {
                    let (c, id) = grants.remove(i as usize % grants.len());
                    match b.name_grant(c, id, k as u128) {
                        Named::Reserved => puts.push((c, id)),
                        Named::Present => prop_assert!(b.reservation(c, id).is_none()),
                        Named::Unknown => prop_assert!(false, "a held grant is unknown"),
                    }
                },
            }
            if let Err(e) = b.check() {
                prop_assert!(false, "books inconsistent: {e}");
            }
            // Leased blocks are still indexed.
            for (c, id, _) in &leases {
                prop_assert!(b.blocks.contains_key(id), "leased block {id} of {c} evicted");
            }
            let mut ranges: Vec<(u64, u64)> = b.blocks.values().map(|x| (x.offset, x.bytes))
                .chain(b.reservations.values().map(|r| (r.offset, r.bytes)))
                .collect();
            ranges.sort_unstable();
            for w in ranges.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
            }
            if let Some(last) = ranges.last() {
                prop_assert!(last.0 + last.1 <= 128);
            }
        }
    }
}

#[test]
fn a_damaged_block_is_invisible_at_once_while_another_reader_holds_it() {
    let mut b = Books::new(4 * 10);
    let c = b.attach(0, "m").unwrap();
    let r1 = b.attach(0, "m").unwrap();
    let r2 = b.attach(0, "m").unwrap();
    put(&mut b, c, 1, 10).unwrap();
    let l1 = b.begin_get(r1, 1).unwrap();
    let l2 = b.begin_get(r2, 1).unwrap();
    assert!(b.drop_block(r2, l2.id));
    assert_eq!(
        b.contains(c, &[1]),
        vec![false],
        "invisible while r1 holds it"
    );
    assert!(b.begin_get(c, 1).is_none());
    // Its slot stays r1's until r1's lease ends; a new copy of the key may be stored.
    let g = put(&mut b, c, 1, 10).unwrap();
    assert_ne!(g, l1.offset);
    b.end_get(r1, l1.id);
    assert_eq!(
        b.contains(c, &[1]),
        vec![true],
        "the new copy stays visible"
    );
    assert!(
        !b.drop_block(c, l1.id),
        "only a lease holder reports damage"
    );
}

#[test]
fn a_range_freed_by_one_block_size_serves_another() {
    let mut b = Books::new(4 * 10);
    let a = b.attach(0, "a").unwrap();
    let q = b.attach(0, "q").unwrap();
    for k in 0..4 {
        put(&mut b, a, k, 10).unwrap();
    }
    // q holds nothing: a (4 slots, share 2) gives up two neighbours for one 20-byte block.
    assert!(put(&mut b, q, 100, 20).is_ok());
    assert_eq!(b.stats().puts_full, 0);
    // Emptied by damage, the arena serves a 40-byte block.
    let mut held = Vec::new();
    for k in 0..4 {
        if let Some(l) = b.begin_get(a, k) {
            held.push(l.id);
        }
    }
    for id in held {
        assert!(b.drop_block(a, id));
    }
    let l = b.begin_get(q, 100).unwrap();
    assert!(b.drop_block(q, l.id));
    assert_eq!(b.stats().bytes_used, 0);
    assert!(
        put(&mut b, q, 101, 40).is_ok(),
        "an empty arena is not full"
    );
}

#[test]
fn namespaces_are_per_owner_capped_and_forgotten_when_unused() {
    let mut b = Books::new(100);
    b.set_max_namespaces(2);
    let mine = b.attach(0, "m").unwrap();
    let theirs = b.attach(7, "m").unwrap();
    put(&mut b, mine, 1, 10).unwrap();
    assert_eq!(
        b.contains(theirs, &[1]),
        vec![false],
        "uid 7's m is not uid 0's m"
    );
    assert_eq!(b.namespace_of(theirs), Some("7/m"));
    assert_eq!(
        b.attach(0, "third"),
        Err(AttachRefused::TooManyNamespaces(2))
    );
    b.detach(theirs); // no client, no block: forgotten
    assert_eq!(b.namespace_count(), 1);
    let t = b.attach(0, "third").unwrap();
    b.detach(mine); // 0/m keeps its block
    b.detach(t);
    assert_eq!(b.namespace_count(), 1);
    let again = b.attach(0, "m").unwrap();
    assert_eq!(b.contains(again, &[1]), vec![true]);
}

#[test]
fn a_grant_is_invisible_until_named_and_committed_and_only_its_client_names_it() {
    let mut b = Books::new(800);
    let w = b.attach(0, "m").unwrap();
    let r = b.attach(0, "m").unwrap();
    let g = b.grant(w, 40).unwrap();
    assert_eq!(b.stats().bytes_granted, 40);
    assert!(!b.commit_put(w, g.id, None), "an unnamed grant has no key");
    assert_eq!(b.reservation(w, g.id), None);
    assert_eq!(
        b.name_grant(r, g.id, 1),
        Named::Unknown,
        "another client's grant"
    );
    assert_eq!(b.name_grant(w, g.id, 1), Named::Reserved);
    assert_eq!(b.name_grant(w, g.id, 2), Named::Unknown, "named once");
    assert_eq!(b.stats().bytes_granted, 0);
    assert_eq!(b.contains(r, &[1]), vec![false], "named, not committed");
    assert_eq!(
        b.begin_put(r, 1, 40),
        Err(PutRefused::Present),
        "being written"
    );
    assert!(b.commit_put(w, g.id, None));
    assert_eq!(b.contains(r, &[1]), vec![true]);
    assert_eq!(b.begin_get(r, 1).map(|l| l.offset), Some(g.offset));
    // A key stored already: the grant goes back, its slot is free.
    let g2 = b.grant(w, 40).unwrap();
    assert_eq!(b.name_grant(w, g2.id, 1), Named::Present);
    assert_eq!(b.stats().bytes_granted, 0);
    assert_eq!(b.name_grant(w, g2.id, 3), Named::Unknown, "given back");
    b.check().unwrap();
    // Grants vanish with their client, counted as no abandoned put; named ones are.
    let g3 = b.grant(w, 40).unwrap();
    let g4 = b.grant(w, 40).unwrap();
    assert_eq!(b.name_grant(w, g4.id, 4), Named::Reserved);
    b.detach(w);
    assert_eq!(b.stats().abandoned_puts, 1);
    assert_eq!(b.stats().bytes_granted, 0);
    assert_eq!(b.contains(r, &[4]), vec![false]);
    let _ = g3;
    b.check().unwrap();
}

#[test]
fn grants_are_capped_per_client_and_in_all() {
    // capacity / GRANT_SHARE = 100 bytes of grants in all.
    let mut b = Books::new(100 * GRANT_SHARE);
    let c = b.attach(0, "m").unwrap();
    let d = b.attach(0, "m").unwrap();
    assert!(b.grant(c, 60).is_ok());
    assert_eq!(
        b.grant(d, 60),
        Err(PutRefused::Full),
        "over the node's share"
    );
    let g = b.grant(d, 40).unwrap();
    assert_eq!(b.grant(c, 1), Err(PutRefused::Full));
    b.abort_put(d, g.id);
    assert!(
        b.grant(c, 1).is_ok(),
        "an aborted grant's bytes count no more"
    );
    assert_eq!(b.stats().puts_full, 0, "a refused grant is no refused put");
    assert_eq!(b.grant(c, u64::MAX), Err(PutRefused::Full), "no overflow");
    // MAX_GRANTS per client.
    let mut e = Books::new(u64::from(MAX_GRANTS + 1) * GRANT_SHARE);
    let c = e.attach(0, "m").unwrap();
    for _ in 0..MAX_GRANTS {
        e.grant(c, 1).unwrap();
    }
    assert_eq!(e.grant(c, 1), Err(PutRefused::Full));
    let d = e.attach(0, "m").unwrap();
    assert!(e.grant(d, 1).is_ok(), "another client has its own count");
    e.check().unwrap();
}
