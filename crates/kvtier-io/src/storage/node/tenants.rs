//! The node's arenas, one per tenant: the node's own uid has one and each `--allow-uid` uid
//! another, each a shared-memory file of the node's uid with books of its own. The capacity is
//! split evenly between them. The node's own uid's arena is a 0600 file in `--shm-dir`; an
//! allowed uid's is a memfd (no path) whose size is sealed before it is passed, so a tenant
//! cannot truncate it under the node's mapping (a SIGBUS would end the node for every tenant).
//! Arena names are `kvtier-node-<pid>-<index>-<64 random bits, hex>.arena`: the file is created
//! exclusively (`O_EXCL`), so a name another user could guess (the pid is public) would let them
//! plant a file there and keep the node from starting; a name found taken is tried again with
//! fresh random bits, [`ARENA_NAME_TRIES`] times in all (this also keeps two nodes of one
//! process on one `--shm-dir` apart).
//!
//! Invariants: a connection is bound to the arena of its peer's uid (`SO_PEERCRED`, checked at
//! accept) and is passed that arena's descriptor alone, so a process can map, read and write
//! only its own uid's arena: a tenant can neither read another uid's blocks nor write a byte of
//! them (docs/arch/node.md, Trust 6). Every block, reservation and lease lives in the books of
//! its arena. Every arena is therefore written only by clients of one uid and by the node, which
//! is why each `Welcome` says `private` (Trust 9). A uid listed twice, or the node's own uid in
//! `--allow-uid`, has one arena.
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::books::{Books, NodeStats};
use super::server::{HugePages, NodeOptions};
use crate::sys::shm::Arena;
use crate::sys::sock;

/// Random names tried for the node's own arena file before its start fails (a name is taken
/// only when a file holds it already: 64 random bits make a second collision unheard of).
const ARENA_NAME_TRIES: usize = 8;

/// One uid's arena and its books.
pub(super) struct Tenant {
    pub(super) uid: u32,
    pub(super) books: Mutex<Books>,
    pub(super) arena: Arena,
    /// The arena's file (the node's own uid's; another uid's has no path).
    pub(super) arena_path: Option<PathBuf>,
    pub(super) arena_bytes: u64,
}

/// Every tenant of a node, the node's own uid first.
pub(super) struct Tenants {
    list: Vec<Tenant>,
}

impl Tenants {
    /// An arena and books for the node's uid and for each allowed uid, in `opts.shm_dir`.
    /// `keep_evicted`: the books keep evicted blocks for the node's disk tier.
    pub(super) fn create(opts: &NodeOptions, keep_evicted: bool) -> io::Result<Self> {
        let me = sock::current_uid();
        let mut uids = vec![me];
        for &u in &opts.allowed_uids {
            if !uids.contains(&u) {
                uids.push(u);
            }
        }
        let share = opts.capacity / uids.len() as u64;
        if share == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a capacity of {} bytes split between {} users (the node's and --allow-uid) \
                     leaves none to each",
                    opts.capacity,
                    uids.len()
                ),
            ));
        }
        let mut list: Vec<Tenant> = Vec::with_capacity(uids.len());
        for (i, &uid) in uids.iter().enumerate() {
            // Another uid's arena is sealed (see the module docs); the node's own uid may signal
            // the node anyway, so its arena stays a file in `--shm-dir` (which may be a tmpfs
            // mounted huge=always).
            let made = if uid == me {
                create_own_arena(&opts.shm_dir, share, opts.huge_pages, || arena_name(i))
                    .map(|(a, p)| (a, Some(p)))
            } else {
                arena_name(i).and_then(|name| {
                    create_arena(None, &name, share, opts.huge_pages).map(|a| (a, None))
                })
            };
            let (arena, path) = match made {
                Ok(x) => x,
                Err(e) => {
                    // The arenas made so far go with the failed start (their files too).
                    for p in list.iter().filter_map(|t| t.arena_path.as_ref()) {
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(e);
                }
            };
            let mut books = Books::with_policy(share, opts.share.clone());
            books.set_keep_evicted(keep_evicted);
            books.set_max_namespaces(opts.max_namespaces);
            list.push(Tenant {
                uid,
                books: Mutex::new(books),
                arena,
                arena_path: path,
                arena_bytes: share,
            });
        }
        Ok(Tenants { list })
    }

    /// The tenant of `uid`, if it may attach.
    pub(super) fn of(&self, uid: u32) -> Option<&Tenant> {
        self.list.iter().find(|t| t.uid == uid)
    }

    /// Every tenant, the node's own uid first.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.list.iter()
    }

    /// The node's own arena's path (for logs).
    pub(super) fn first_path(&self) -> Option<&Path> {
        self.list.first().and_then(|t| t.arena_path.as_deref())
    }
}

impl NodeStats {
    /// Adds `o`'s counters to these (a node's tenants' books, summed).
    pub(super) fn add(&mut self, o: &NodeStats) {
        let NodeStats {
            clients,
            blocks,
            bytes_used,
            capacity,
            puts,
            puts_full,
            gets,
            get_misses,
            evictions,
            abandoned_puts,
            disk_blocks,
            disk_spills,
            disk_hits,
            requests,
            verified,
            bytes_granted,
        } = *o;
        self.clients += clients;
        self.blocks += blocks;
        self.bytes_used += bytes_used;
        self.capacity += capacity;
        self.puts += puts;
        self.puts_full += puts_full;
        self.gets += gets;
        self.get_misses += get_misses;
        self.evictions += evictions;
        self.abandoned_puts += abandoned_puts;
        self.disk_blocks += disk_blocks;
        self.disk_spills += disk_spills;
        self.disk_hits += disk_hits;
        self.requests += requests;
        self.verified += verified;
        self.bytes_granted += bytes_granted;
    }
}

/// A fresh arena name for tenant `index` (see the module docs).
fn arena_name(index: usize) -> io::Result<String> {
    let r = getrandom::u64()
        .map_err(|e| io::Error::other(format!("no random bits for the arena's name: {e}")))?;
    Ok(format!(
        "kvtier-node-{}-{index}-{r:016x}.arena",
        std::process::id()
    ))
}

/// The node's own uid's arena of `bytes`: a new file in `dir` named by `name` (a fresh random
/// name at each call: [`arena_name`]), another name tried while one is taken, up to
/// [`ARENA_NAME_TRIES`] in all (see the module docs). The arena and its path.
fn create_own_arena(
    dir: &Path,
    bytes: u64,
    huge: HugePages,
    mut name: impl FnMut() -> io::Result<String>,
) -> io::Result<(Arena, PathBuf)> {
    let mut left = ARENA_NAME_TRIES;
    loop {
        left -= 1;
        let name = name()?;
        let path = dir.join(&name);
        match create_arena(Some(&path), &name, bytes, huge) {
            Ok(a) => return Ok((a, path)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && left > 0 => {
                tracing::warn!(path = %path.display(), "the arena's name is taken; trying another");
            }
            Err(e) => return Err(e),
        }
    }
}

/// An arena of `bytes`: a locked file at `path`, or a sealed memfd named `name` without one;
/// collapsed into 2 MiB pages when `huge` asks for it.
fn create_arena(path: Option<&Path>, name: &str, bytes: u64, huge: HugePages) -> io::Result<Arena> {
    let len = usize::try_from(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "capacity too large"))?;
    let made = match path {
        Some(p) => Arena::create(p, len, true),
        None => Arena::create_sealed(name, len),
    };
    let shown = path.map_or_else(|| format!("memfd:{name}"), |p| p.display().to_string());
    let arena = made.map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot reserve {bytes} bytes of shared memory at {shown}: {e}"),
        )
    })?;
    if huge == HugePages::Collapse {
        let t = std::time::Instant::now();
        // One thread per core: the kernel's copy runs on the thread that asks.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        match arena.collapse_huge(threads) {
            Ok((0, _)) => {}
            Ok((refused, e)) => tracing::warn!(
                refused,
                "part of the node's arena stayed on small pages: {e:?}"
            ),
            Err(e) => tracing::warn!("the node's arena was not collapsed into 2 MiB pages: {e}"),
        }
        tracing::info!(
            seconds = t.elapsed().as_secs_f64(),
            "arena collapse into 2 MiB pages"
        );
    }
    tracing::info!(
        bytes,
        path = %shown,
        huge_mapped = arena.huge_mapped_bytes(),
        "node arena mapped (bytes in 2 MiB pages, where /proc/self/smaps tells)"
    );
    Ok(arena)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A taken name (here a directory: the exclusive create fails on any entry) is passed over
    /// for the next one; the start fails only once [`ARENA_NAME_TRIES`] names were all taken.
    #[test]
    fn a_taken_arena_name_is_tried_again_a_bounded_number_of_times() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..=ARENA_NAME_TRIES)
            .map(|k| format!("kvtier-node-test-{k}.arena"))
            .collect();
        for taken in &names[..ARENA_NAME_TRIES - 1] {
            std::fs::create_dir(dir.path().join(taken)).unwrap();
        }
        let mut next = names.iter().cloned();
        let mut calls = 0;
        let mut name = || {
            calls += 1;
            next.next().ok_or_else(|| io::Error::other("out of names"))
        };
        let (a, path) = create_own_arena(dir.path(), 4096, HugePages::Advise, &mut name).unwrap();
        assert_eq!(path, dir.path().join(&names[ARENA_NAME_TRIES - 1]));
        assert_eq!(calls, ARENA_NAME_TRIES);
        drop(a);
        // Every name taken: refused after the last try, never looping on.
        std::fs::create_dir(dir.path().join(&names[ARENA_NAME_TRIES])).unwrap();
        let mut calls = 0;
        let mut names = names.iter().skip(1).cloned();
        let e = create_own_arena(dir.path(), 4096, HugePages::Advise, || {
            calls += 1;
            names.next().ok_or_else(|| io::Error::other("out of names"))
        })
        .map(|_| ())
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(calls, ARENA_NAME_TRIES);
    }

    #[test]
    fn arena_names_are_random_and_found_by_the_stale_arena_reclaim() {
        let (a, b) = (arena_name(0).unwrap(), arena_name(0).unwrap());
        assert_ne!(a, b);
        let prefix = format!("kvtier-node-{}-0-", std::process::id());
        for n in [&a, &b] {
            // `listen::reclaim_stale_arenas` matches this prefix and suffix.
            assert!(n.starts_with(&prefix) && n.ends_with(".arena"), "{n}");
            assert_eq!(n.len(), prefix.len() + 16 + ".arena".len(), "{n}");
        }
    }
}
