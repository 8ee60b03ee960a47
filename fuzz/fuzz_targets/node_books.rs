//! The node tier's books (`kvtier_io::storage::node::Books`, the state machine `kvtier node` runs for
//! every client request) under arbitrary sequences of attach, detach, put (begin, commit,
//! abort), grants (taken before their key, named, committed or given back), get (begin, end),
//! damage reports and lookups, from any clients and users, with
//! block sizes that differ and do not fit: never panics, and after every operation
//! `Books::check` holds (each arena byte free or owned exactly once, index, LRU, leases,
//! namespaces and counters consistent); a committed block is visible to its namespace at once
//! and to no other user's namespace; a reserved key is never visible.
#![no_main]
use kvtier_io::storage::node::{Books, ClientId, Named};
use libfuzzer_sys::fuzz_target;

const CAPACITY: u64 = 256;

fuzz_target!(|data: &[u8]| {
    let mut b = Books::new(CAPACITY);
    b.set_max_namespaces(3);
    b.set_keep_evicted(data.first().is_some_and(|x| x & 1 == 1));
    // (client, owner uid, namespace)
    let mut clients: Vec<(ClientId, u32, u8)> = Vec::new();
    let mut puts: Vec<(ClientId, u64, u128)> = Vec::new();
    let mut leases: Vec<(ClientId, u64)> = Vec::new();
    let mut grants: Vec<(ClientId, u64)> = Vec::new();
    // Every (owner, namespace, key) ever committed.
    let mut committed: Vec<(u32, u8, u128)> = Vec::new();
    for op in data.chunks_exact(4) {
        let (a, x, y) = (op[1], op[2], op[3]);
        let pick = |n: usize| (a as usize) % n.max(1);
        match op[0] % 12 {
            0 => {
                let (owner, ns) = (u32::from(x % 2), y % 4);
                let name = ["m", "n", "o", ""][ns as usize];
                if let Ok(c) = b.attach(owner, name) {
                    clients.push((c, owner, ns));
                }
            }
            1 if !clients.is_empty() => {
                let (c, _, _) = clients.remove(pick(clients.len()));
                b.detach(c);
                puts.retain(|p| p.0 != c);
                leases.retain(|l| l.0 != c);
                grants.retain(|g| g.0 != c);
            }
            2 if !clients.is_empty() => {
                let (c, _, _) = clients[pick(clients.len())];
                let bytes = [8u64, 16, 24, 64, 0, CAPACITY, CAPACITY + 1, 40][y as usize % 8];
                let key = u128::from(x % 16);
                if let Ok(g) = b.begin_put(c, key, bytes) {
                    assert!(g.offset + g.bytes <= CAPACITY);
                    assert!(!b.contains(c, &[key])[0], "a reserved key is visible");
                    puts.push((c, g.id, key));
                }
            }
            3 if !puts.is_empty() => {
                let (c, id, key) = puts.remove(pick(puts.len()));
                let sum = (y & 1 == 1).then_some(u64::from(y));
                assert!(b.commit_put(c, id, sum));
                assert!(b.contains(c, &[key])[0], "a committed block is not visible");
                let (_, owner, ns) = *clients.iter().find(|x| x.0 == c).expect("live writer");
                committed.push((owner, ns, key));
                // Another user's namespace of the same name sees the key only if it stored it too.
                for (o, own, n) in &clients {
                    if *own != owner && *n == ns && !committed.contains(&(*own, *n, key)) {
                        assert!(!b.contains(*o, &[key])[0], "a block crossed users");
                    }
                }
            }
            4 if !puts.is_empty() => {
                let (c, id, _) = puts.remove(pick(puts.len()));
                b.abort_put(c, id);
            }
            5 if !clients.is_empty() => {
                let (c, _, _) = clients[pick(clients.len())];
                if let Some(g) = b.begin_get(c, u128::from(x % 16)) {
                    assert!(g.offset + g.bytes <= CAPACITY);
                    leases.push((c, g.id));
                }
            }
            6 if !leases.is_empty() => {
                let (c, id) = leases.remove(pick(leases.len()));
                assert!(b.end_get(c, id), "a held lease is unknown");
            }
            7 if !leases.is_empty() => {
                let (c, id) = leases.remove(pick(leases.len()));
                assert!(b.drop_block(c, id));
            }
            8 => {
                // Foreign ids: another client's reservation, a lease nobody holds.
                let c = clients.get(pick(clients.len())).map_or(9999, |c| c.0);
                let id = u64::from(x) | (u64::from(y) << 8);
                let held = puts
                    .iter()
                    .map(|p| (p.0, p.1))
                    .chain(grants.iter().copied());
                let holders: Vec<ClientId> = held.filter(|h| h.1 == id).map(|h| h.0).collect();
                if holders.iter().all(|h| *h != c) {
                    assert!(!b.commit_put(c, id, None));
                    assert_eq!(
                        b.name_grant(c, id, 0),
                        Named::Unknown,
                        "a foreign grant named"
                    );
                    b.abort_put(c, id);
                }
                if !leases.iter().any(|l| l.0 == c && l.1 == id) {
                    assert!(!b.drop_block(c, id));
                    assert!(!b.end_get(c, id), "a lease nobody holds ended");
                }
            }
            9 if !clients.is_empty() => {
                let (c, _, _) = clients[pick(clients.len())];
                let bytes = [8u64, 16, 24, 32, 0, CAPACITY, u64::MAX][y as usize % 7];
                if let Ok(g) = b.grant(c, bytes) {
                    assert!(g.offset + g.bytes <= CAPACITY);
                    assert!(!b.commit_put(c, g.id, None), "an unnamed grant committed");
                    grants.push((c, g.id));
                }
            }
            10 if !grants.is_empty() => {
                let (c, id) = grants.remove(pick(grants.len()));
                let key = u128::from(x % 16);
                let held = b.contains(c, &[key])[0];
                match b.name_grant(c, id, key) {
                    Named::Reserved => {
                        assert!(!held, "a held key was named");
                        assert!(!b.contains(c, &[key])[0], "a named grant is visible");
                        puts.push((c, id, key));
                    }
                    Named::Present => {}
                    Named::Unknown => panic!("a held grant is unknown"),
                }
            }
            _ => {
                let _ = b.take_evicted();
            }
        }
        if let Err(e) = b.check() {
            panic!("books inconsistent after {op:?}: {e}");
        }
    }
    for (c, _, _) in clients {
        b.detach(c);
    }
    b.check().expect("books consistent after every client left");
    assert_eq!(b.stats().clients, 0);
});
