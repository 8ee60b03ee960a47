//! The node service (`kvtier node`): owns the shared arena and its books, and serves attached
//! engine processes over a Unix socket, one thread per connection.
//!
//! Invariants:
//! - the socket file is created mode 0600 inside a directory kvtier owns (mode 0700) and every
//!   peer is checked with `SO_PEERCRED`: only this user (and the uids in `allowed_uids`) attach;
//!   anyone else is refused with a log line;
//! - a connection that ends (clean close, crash, protocol error, read timeout) is detached from
//!   the books at once: its unfinished writes vanish and its leases end, so a crashed engine
//!   leaves no half-written block visible and no leaked lease;
//! - a live socket is never replaced: a second node on the same path refuses to start; a stale
//!   socket (nobody listening) and stale arenas (their flock free) of a dead node are removed;
//! - [`NodeServer::shutdown`] returns within its timeout.
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::books::{BlockCopy, Books, ClientId, NodeStats, PutRefused, SlotGrant};
use super::disk::{disk_key, NodeDisk};
use super::protocol::block_checksum;
use super::protocol::{read_frame, write_frame, Reply, Request, NODE_PROTOCOL_VERSION};
use super::share::SharePolicy;
use crate::sys::shm::{self, Arena};

/// Settings of a node service.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// The Unix socket engines attach to.
    pub socket: PathBuf,
    /// Bytes of shared memory for blocks.
    pub capacity: u64,
    /// Directory of the arena file (tmpfs; default `/dev/shm`).
    pub shm_dir: PathBuf,
    /// Users besides the node's own allowed to attach.
    pub allowed_uids: Vec<u32>,
    /// A connection idle this long is closed (its client detached).
    pub idle_timeout: Duration,
    /// How the arena is shared among namespaces (default: equal shares).
    pub share: SharePolicy,
    /// The node's disk tier behind the arena (`--disk-dir`; none by default) and its size.
    pub disk_dir: Option<PathBuf>,
    /// Bytes of that disk tier (0: no disk tier).
    pub disk_bytes: u64,
}

impl NodeOptions {
    /// Options for a node at `socket` with `capacity` bytes of arena; the rest at their defaults.
    pub fn new(socket: impl Into<PathBuf>, capacity: u64) -> Self {
        NodeOptions {
            socket: socket.into(),
            capacity,
            shm_dir: PathBuf::from("/dev/shm"),
            allowed_uids: Vec::new(),
            idle_timeout: Duration::from_secs(3600),
            share: SharePolicy::Equal,
            disk_dir: None,
            disk_bytes: 0,
        }
    }
}

struct Shared {
    books: Mutex<Books>,
    /// The disk tier behind the arena; locked only while `books` is held (lock order: books,
    /// then disk), so an evicted block is copied out before its slot's new writer hears of it.
    disk: Option<Mutex<NodeDisk>>,
    arena: Arena,
    arena_path: PathBuf,
    arena_bytes: u64,
    stop: AtomicBool,
    allowed: Vec<u32>,
    idle: Duration,
    /// Connection threads and a handle on their sockets (shut down to end them).
    conns: Mutex<Vec<(JoinHandle<()>, UnixStream)>>,
}

/// A running node service (see the module docs).
pub struct NodeServer {
    shared: Arc<Shared>,
    socket: PathBuf,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for NodeServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeServer")
            .field("socket", &self.socket)
            .field("arena", &self.shared.arena_path)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Remove arenas of nodes that died (their flock is free) from `dir`.
fn reclaim_stale_arenas(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("kvtier-node-") && name.ends_with(".arena")) {
            continue;
        }
        let Ok(f) = std::fs::File::open(e.path()) else {
            continue;
        };
        if shm::flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            tracing::info!(path = %e.path().display(), "removing the arena of a node that is gone");
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl NodeServer {
    /// Create the arena, bind the socket and start serving.
    pub fn start(opts: &NodeOptions) -> io::Result<NodeServer> {
        let cap = usize::try_from(opts.capacity)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "capacity too large"))?;
        if let Some(dir) = opts.socket.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)?;
            }
        }
        if opts.socket.exists() {
            if UnixStream::connect(&opts.socket).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("a kvtier node already serves {}", opts.socket.display()),
                ));
            }
            std::fs::remove_file(&opts.socket)?;
        }
        reclaim_stale_arenas(&opts.shm_dir);
        let arena_path = opts
            .shm_dir
            .join(format!("kvtier-node-{}.arena", std::process::id()));
        let arena = Arena::create(&arena_path, cap, true).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot reserve {} bytes of shared memory at {}: {e}",
                    opts.capacity,
                    arena_path.display()
                ),
            )
        })?;
        let disk = match &opts.disk_dir {
            Some(d) if opts.disk_bytes > 0 => {
                Some(Mutex::new(NodeDisk::open(d, opts.disk_bytes).map_err(
                    |e| io::Error::other(format!("the node's disk tier at {}: {e}", d.display())),
                )?))
            }
            _ => None,
        };
        let mut books = Books::with_policy(opts.capacity, opts.share.clone());
        books.set_keep_evicted(disk.is_some());
        let listener = UnixListener::bind(&opts.socket)?;
        std::fs::set_permissions(&opts.socket, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            books: Mutex::new(books),
            disk,
            arena,
            arena_path: arena_path.clone(),
            arena_bytes: opts.capacity,
            stop: AtomicBool::new(false),
            allowed: opts.allowed_uids.clone(),
            idle: opts.idle_timeout,
            conns: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("kvtier-node".into())
            .spawn(move || accept_loop(&listener, &s))?;
        tracing::info!(socket = %opts.socket.display(), arena = %arena_path.display(), capacity = opts.capacity, "kvtier node serving");
        Ok(NodeServer {
            shared,
            socket: opts.socket.clone(),
            accept: Some(accept),
        })
    }

    /// The Unix socket engines attach to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The node's counters.
    pub fn stats(&self) -> super::books::NodeStats {
        stats(&self.shared, &lock(&self.shared.books))
    }

    /// Stop accepting, close every connection and remove the socket and the arena file;
    /// returns within `timeout` (threads still running then are left to exit on their own).
    pub fn shutdown(&mut self, timeout: Duration) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        if let Some(h) = self.accept.take() {
            join_by(h, deadline);
        }
        let conns: Vec<_> = std::mem::take(&mut *lock(&self.shared.conns));
        for (_, sock) in &conns {
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
        for (h, _) in conns {
            join_by(h, deadline);
        }
        if let Some(d) = &self.shared.disk {
            // The arena dies with the node: its blocks go to disk (verified), for the next one.
            let books = lock(&self.shared.books);
            let mut disk = lock(d);
            for b in books.committed() {
                spill_one(&self.shared.arena, &mut disk, &b);
            }
            disk.sync();
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.shared.arena_path);
    }
}

impl Drop for NodeServer {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.shutdown(Duration::from_secs(2));
        }
    }
}

fn join_by(h: JoinHandle<()>, deadline: Instant) {
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if h.is_finished() {
        let _ = h.join();
    }
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    let me = shm::current_uid();
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let uid = shm::peer_uid(&stream);
                match uid {
                    Ok(u) if u == me || shared.allowed.contains(&u) => {}
                    Ok(u) => {
                        kvtier::warn_limited!(
                            uid = u,
                            "kvtier node: refused a client of another user"
                        );
                        continue;
                    }
                    Err(e) => {
                        kvtier::warn_limited!(error = %e, "kvtier node: refused a client without credentials");
                        continue;
                    }
                }
                let Ok(handle) = stream.try_clone() else {
                    continue;
                };
                let s = Arc::clone(shared);
                match std::thread::Builder::new()
                    .name("kvtier-node-conn".into())
                    .spawn(move || serve(stream, &s))
                {
                    Ok(h) => {
                        let mut conns = lock(&shared.conns);
                        conns.retain(|(h, _)| !h.is_finished());
                        conns.push((h, handle));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "kvtier node: cannot start a connection thread")
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                kvtier::warn_limited!(error = %e, "kvtier node: accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Serve one connection until it ends; the client is always detached afterwards.
fn serve(stream: UnixStream, shared: &Shared) {
    // Blocking reads bounded by the idle timeout; shutdown ends them by shutting the socket.
    if stream.set_nonblocking(false).is_err() || stream.set_read_timeout(Some(shared.idle)).is_err()
    {
        return;
    }
    let mut client: Option<ClientId> = None;
    let mut reader = match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    let mut writer = stream;
    while !shared.stop.load(Ordering::SeqCst) {
        let req: Request = match read_frame(&mut reader) {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "kvtier node: connection ended");
                break;
            }
        };
        let reply = handle(shared, &mut client, req);
        if write_frame(&mut writer, &reply).is_err() {
            break;
        }
    }
    if let Some(id) = client {
        lock(&shared.books).detach(id);
    }
}

fn handle(shared: &Shared, client: &mut Option<ClientId>, req: Request) -> Reply {
    let mut books = lock(&shared.books);
    let Some(id) = *client else {
        return match req {
            Request::Hello { version, namespace } => {
                if version != NODE_PROTOCOL_VERSION {
                    return Reply::Refused(format!(
                        "node protocol {version} is not this node's {NODE_PROTOCOL_VERSION}"
                    ));
                }
                if namespace.is_empty() {
                    return Reply::Refused("an empty namespace".into());
                }
                *client = Some(books.attach(&namespace));
                Reply::Welcome {
                    arena_path: shared.arena_path.display().to_string(),
                    arena_bytes: shared.arena_bytes,
                }
            }
            _ => Reply::Refused("the first message must be Hello".into()),
        };
    };
    match req {
        Request::Hello { .. } => Reply::Refused("already attached".into()),
        Request::Contains(keys) => {
            let mut present = books.contains(id, &keys);
            if let (Some(d), Some(ns)) = (&shared.disk, books.namespace_of(id)) {
                let disk = lock(d);
                for (p, k) in present.iter_mut().zip(&keys) {
                    *p = *p || disk.contains(disk_key(ns, *k), None);
                }
            }
            Reply::Present(present)
        }
        Request::BeginPut { bytes, .. } if bytes == 0 || bytes > shared.arena_bytes => {
            Reply::Refused(format!(
                "a block of {bytes} bytes does not fit this node's {} bytes",
                shared.arena_bytes
            ))
        }
        Request::BeginPut { key, bytes } => {
            let r = books.begin_put(id, key, bytes);
            spill_evicted(shared, &mut books);
            match r {
                Ok(g) => Reply::PutSlot {
                    id: g.id,
                    offset: g.offset,
                },
                Err(PutRefused::Present) => Reply::AlreadyPresent,
                Err(PutRefused::Full) => Reply::Full,
            }
        }
        Request::CommitPut { id: put, checksum } => {
            if books.commit_put(id, put, checksum) {
                Reply::Done
            } else {
                Reply::Refused(format!("no write {put} of this client"))
            }
        }
        Request::AbortPut(put) => {
            books.abort_put(id, put);
            Reply::Done
        }
        Request::BeginGet(key) => match books
            .begin_get(id, key)
            .or_else(|| promote(shared, &mut books, id, key))
        {
            Some(g) => Reply::Lease {
                id: g.id,
                offset: g.offset,
                bytes: g.bytes,
                checksum: g.checksum,
            },
            None => Reply::Missing,
        },
        Request::EndGet(lease) => {
            books.end_get(id, lease);
            Reply::Done
        }
        Request::Damaged(lease) => {
            tracing::warn!(
                lease,
                "kvtier node: a client found a damaged block; dropped"
            );
            books.drop_block(id, lease);
            Reply::Done
        }
        Request::Stats => {
            let s = stats(shared, &books);
            Reply::Stats {
                clients: s.clients,
                blocks: s.blocks,
                bytes_used: s.bytes_used,
                capacity: s.capacity,
                puts: s.puts,
                puts_full: s.puts_full,
                gets: s.gets,
                get_misses: s.get_misses,
                evictions: s.evictions,
                abandoned_puts: s.abandoned_puts,
                disk_blocks: s.disk_blocks,
                disk_spills: s.disk_spills,
                disk_hits: s.disk_hits,
            }
        }
    }
}

/// The books' counters plus the disk tier's.
fn stats(shared: &Shared, books: &Books) -> NodeStats {
    let mut s = books.stats();
    if let Some(d) = &shared.disk {
        let d = lock(d);
        s.disk_blocks = d.len() as u64;
        s.disk_spills = d.spilled;
        s.disk_hits = d.hits;
    }
    s
}

/// Copy the blocks just evicted from the arena to the disk tier (under the books' lock: their
/// slots' new writers have not been told yet).
fn spill_evicted(shared: &Shared, books: &mut Books) {
    let Some(d) = &shared.disk else { return };
    let evicted = books.take_evicted();
    if evicted.is_empty() {
        return;
    }
    let mut disk = lock(d);
    for b in &evicted {
        spill_one(&shared.arena, &mut disk, b);
    }
}

/// Write one arena block to disk if its bytes still match the checksum its writer committed.
fn spill_one(arena: &Arena, disk: &mut NodeDisk, b: &BlockCopy) {
    let Ok(n) = usize::try_from(b.bytes) else {
        return;
    };
    let mut buf = vec![0u8; n];
    if arena.read(b.offset, &mut buf).is_err() || block_checksum(b.key, &buf) != b.checksum {
        tracing::warn!("kvtier node: a damaged arena block was not spilled");
        return;
    }
    disk.spill(disk_key(&b.namespace, b.key), &buf);
}

/// An arena miss served from the disk tier: the block is read (verified by the disk tier) into
/// a slot reserved for `client`, committed, then leased to it like any arena block.
fn promote(shared: &Shared, books: &mut Books, client: ClientId, key: u128) -> Option<SlotGrant> {
    let d = shared.disk.as_ref()?;
    let dkey = disk_key(books.namespace_of(client)?, key);
    let bytes = lock(d).block_bytes_of(dkey)?;
    let g = books.begin_put(client, key, bytes as u64);
    spill_evicted(shared, books);
    let g = g.ok()?;
    let mut buf = vec![0u8; bytes];
    let read = lock(d).read(dkey, &mut buf) && shared.arena.write(g.offset, &buf).is_ok();
    if !read {
        books.abort_put(client, g.id);
        return None;
    }
    books.commit_put(client, g.id, block_checksum(key, &buf));
    books.begin_get(client, key)
}
