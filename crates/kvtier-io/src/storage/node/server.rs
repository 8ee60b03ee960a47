//! The node service (`kvtier node`): owns the arenas (one per tenant uid, `tenants.rs`) and their
//! books, and serves attached engine processes over a Unix socket, one thread per connection.
//!
//! Invariants:
//! - the socket is created in a directory of the node's own uid that nobody else can write
//!   (`listen.rs`), mode 0600 (0666 in a 0711 directory with `allowed_uids`), and every peer
//!   is checked with `SO_PEERCRED`: only this user and the uids in `allowed_uids` attach;
//!   anyone else is refused with a (rate-limited) log line;
//! - a client's namespace is qualified by its uid (`<uid>/<declared>`) and lives in its uid's
//!   arena and books: tenants of different uids never see each other's blocks, through the
//!   protocol or through memory; that arena reaches a client only as a descriptor passed after
//!   `Welcome`, never as a path;
//! - bounded: at most `max_connections` connections per uid (more are closed at once), frames of at
//!   most [`MAX_HELLO_FRAME`] bytes before `Hello` and `MAX_FRAME` after, read as they arrive;
//!   `Hello` within `hello_timeout`; namespaces of at most `max_namespace_len` bytes and
//!   `max_namespaces` per uid's arena (unused ones are forgotten);
//! - every arena is written only by clients of one uid and by the node, so every `Welcome` says
//!   `private` and a commit without a checksum is published as written (those writers are
//!   trusted alike);
//! - a block committed with a checksum becomes visible only if the bytes in its slot at commit
//!   time hash to it: the node re-hashes a `Finish`'s slots in parallel outside the books' lock
//!   (the slots are this connection's reservations, handed to no one else meanwhile) and
//!   publishes the batch under one lock; a block reported damaged is invisible at once;
//! - a batch (`Reserve`, `Finish`, `Lease`, `EndLeases`) of more than [`MAX_BATCH`] items is
//!   refused whole; otherwise each item gets one answer, in order; the evicted blocks of a
//!   `Reserve` are spilled to disk before its reply leaves (no writer knows its slot yet);
//! - a connection that ends (clean close, crash, protocol error, idle or hello timeout) is shut
//!   down both ways, so its peer sees end of stream at once, and detached from the books: its
//!   unfinished writes vanish and its leases end, so a crashed engine leaves no half-written
//!   block visible and no leaked lease;
//! - a live socket is never replaced: a second node on the same path refuses to start; a stale
//!   socket (a socket nobody listens on, never another kind of file) and stale arenas (their
//!   flock free) of a dead node are removed;
//! - [`NodeServer::shutdown`] returns within its timeout.
use std::io::{self, Read};
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::books::MAX_NAMESPACES;
use super::books::{BlockCopy, Books, ClientId, Named, NodeStats, PutRefused, SlotGrant};
use super::disk::{disk_key, NodeDisk};
use super::hash::slot_checksums;
use super::listen;
use super::protocol::{block_checksum, read_frame, read_frame_max, spin_readable, write_frame};
use super::protocol::{GetAnswer, ItemAnswer, LeaseEnd, PutAnswer, PutEnd, Reply, Request};
use super::protocol::{MAX_BATCH, MAX_HELLO_FRAME, NODE_POLL, NODE_PROTOCOL_VERSION};
use super::share::SharePolicy;
use super::tenants::{Tenant, Tenants};
use crate::sys::shm::Arena;
use crate::sys::sock;

/// Default cap on concurrent connections of one uid.
pub const MAX_CONNECTIONS: usize = 256;
/// Default cap on a namespace's length, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 256;
/// Default time a new connection has to say `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Connections of one uid served at once; more of that uid are closed at once (default
    /// [`MAX_CONNECTIONS`]), so one tenant cannot lock the others out.
    pub max_connections: usize,
    /// Namespaces held at once in each uid's arena (default [`MAX_NAMESPACES`]).
    pub max_namespaces: usize,
    /// Longest namespace a client may declare, in bytes (default [`MAX_NAMESPACE_LEN`]).
    pub max_namespace_len: usize,
    /// A connection that has not said `Hello` this long after it was accepted is closed.
    pub hello_timeout: Duration,
    /// How the arena gets 2 MiB pages (default [`HugePages::Advise`]).
    pub huge_pages: HugePages,
    /// How long a connection polls for the client's next request after each answer before it
    /// sleeps in `read` (default [`NODE_POLL`]): a request that arrives within it costs no
    /// wake-up; each connection burns a CPU while it polls.
    pub poll: Duration,
}

/// How the node asks for 2 MiB pages for its arena (docs/arch/node.md). The arena is always
/// mapped at a 2 MiB-aligned address and advised `MADV_HUGEPAGE`, which is enough where the
/// machine's `shmem_enabled` is `advise`, `within_size` or `always`, or the `--shm-dir` is a
/// tmpfs mounted `huge=always`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Only the advice (no cost at start).
    #[default]
    Advise,
    /// Also `MADV_COLLAPSE` the whole arena at start, before any engine attaches: huge pages
    /// even where `shmem_enabled` is `never` (the common default), at a cost of seconds per GiB
    /// at start on some machines (docs/bench/node.md). A refusal is logged, not fatal.
    Collapse,
}

impl HugePages {
    /// `advise` or `collapse`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "advise" => Some(Self::Advise),
            "collapse" => Some(Self::Collapse),
            _ => None,
        }
    }
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
            max_connections: MAX_CONNECTIONS,
            max_namespaces: MAX_NAMESPACES,
            max_namespace_len: MAX_NAMESPACE_LEN,
            hello_timeout: HELLO_TIMEOUT,
            huge_pages: HugePages::Advise,
            poll: NODE_POLL,
        }
    }
}

struct Shared {
    /// One arena and books per uid that may attach.
    tenants: Tenants,
    /// The disk tier behind the arenas; locked only while some tenant's `books` is held (lock
    /// order: books, then disk), so an evicted block is copied out before its slot's new writer
    /// hears of it.
    disk: Option<Mutex<NodeDisk>>,
    stop: AtomicBool,
    /// Requests served after `Hello`.
    requests: AtomicU64,
    /// Commits whose slot was hashed against the committed checksum.
    verified: AtomicU64,
    idle: Duration,
    /// [`NodeOptions::poll`].
    poll: Duration,
    hello_timeout: Duration,
    max_connections: usize,
    max_namespace_len: usize,
    /// Connection threads, a handle on their sockets (shut down to end them) and their peers'
    /// uids (each uid may hold `max_connections`).
    conns: Mutex<Vec<(JoinHandle<()>, UnixStream, u32)>>,
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
            .field("arena", &self.shared.tenants.first_path())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NodeServer {
    /// Create the arena, bind the socket and start serving.
    pub fn start(opts: &NodeOptions) -> io::Result<NodeServer> {
        let shared_mode = !opts.allowed_uids.is_empty();
        let dir = match opts.socket.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        listen::prepare_dir(dir, shared_mode)?;
        listen::reclaim_stale_socket(&opts.socket)?;
        listen::reclaim_stale_arenas(&opts.shm_dir);
        let disk = match &opts.disk_dir {
            Some(d) if opts.disk_bytes > 0 => {
                Some(Mutex::new(NodeDisk::open(d, opts.disk_bytes).map_err(
                    |e| io::Error::other(format!("the node's disk tier at {}: {e}", d.display())),
                )?))
            }
            _ => None,
        };
        let tenants = Tenants::create(opts, disk.is_some())?;
        let listener = UnixListener::bind(&opts.socket)?;
        let mode = if shared_mode { 0o666 } else { 0o600 };
        std::fs::set_permissions(&opts.socket, std::fs::Permissions::from_mode(mode))?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            tenants,
            disk,
            stop: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            verified: AtomicU64::new(0),
            idle: opts.idle_timeout,
            poll: opts.poll,
            hello_timeout: opts.hello_timeout,
            max_connections: opts.max_connections.max(1),
            max_namespace_len: opts.max_namespace_len,
            conns: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("kvtier-node".into())
            .spawn(move || accept_loop(&listener, &s))?;
        tracing::info!(socket = %opts.socket.display(), capacity = opts.capacity, tenants = shared.tenants.iter().count(), "kvtier node serving");
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

    /// A descriptor of each uid's arena file, the node's own uid first (tests only).
    #[cfg(any(test, feature = "testing"))]
    pub fn arena_files(&self) -> io::Result<Vec<std::fs::File>> {
        self.shared.tenants.iter().map(|t| t.arena.file()).collect()
    }

    /// The node's counters.
    pub fn stats(&self) -> super::books::NodeStats {
        stats(&self.shared)
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
        for (_, s, _) in &conns {
            let _ = s.shutdown(Shutdown::Both);
        }
        for (h, _, _) in conns {
            join_by(h, deadline);
        }
        if let Some(d) = &self.shared.disk {
            // The arenas die with the node: their blocks go to disk (verified), for the next one.
            for t in self.shared.tenants.iter() {
                let books = lock(&t.books);
                let mut disk = lock(d);
                for b in books.committed() {
                    spill_one(&t.arena, &mut disk, &b);
                }
            }
            lock(d).sync();
        }
        let _ = std::fs::remove_file(&self.socket);
        for p in self
            .shared
            .tenants
            .iter()
            .filter_map(|t| t.arena_path.as_ref())
        {
            let _ = std::fs::remove_file(p);
        }
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
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let uid = match sock::peer_uid(&stream) {
                    Ok(u) if shared.tenants.of(u).is_some() => u,
                    Ok(u) => {
                        kvtier::warn_limited!(
                            uid = u,
                            "kvtier node: refused a client of another user"
                        );
                        let _ = stream.shutdown(Shutdown::Both);
                        continue;
                    }
                    Err(e) => {
                        kvtier::warn_limited!(error = %e, "kvtier node: refused a client without credentials");
                        let _ = stream.shutdown(Shutdown::Both);
                        continue;
                    }
                };
                let mut conns = lock(&shared.conns);
                conns.retain(|(h, _, _)| !h.is_finished());
                // Per uid: a tenant that opens connections by the hundred locks out no other.
                if conns.iter().filter(|c| c.2 == uid).count() >= shared.max_connections {
                    drop(conns);
                    kvtier::warn_limited!(
                        uid,
                        max = shared.max_connections,
                        "kvtier node: too many connections of one user; closed a new one"
                    );
                    let _ = stream.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(handle) = stream.try_clone() else {
                    continue;
                };
                let s = Arc::clone(shared);
                match std::thread::Builder::new()
                    .name("kvtier-node-conn".into())
                    .spawn(move || serve(stream, uid, &s))
                {
                    Ok(h) => conns.push((h, handle, uid)),
                    Err(e) => {
                        let _ = handle.shutdown(Shutdown::Both);
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

/// Reads bounded by a deadline: each read waits at most until `until` (a peer that trickles
/// bytes cannot hold the connection open past it).
struct Deadline<'a> {
    stream: &'a UnixStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no Hello in time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

/// Serve one connection of user `uid` until it ends; it is then shut down both ways (the peer
/// sees end of stream at once) and its client detached.
fn serve(stream: UnixStream, uid: u32, shared: &Shared) {
    let write_limit = Some(shared.idle.clamp(Duration::from_millis(1), HELLO_TIMEOUT));
    if stream.set_nonblocking(false).is_ok() && stream.set_write_timeout(write_limit).is_ok() {
        serve_frames(&stream, uid, shared);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_frames(stream: &UnixStream, uid: u32, shared: &Shared) {
    // Checked at accept: every peer served has a tenant.
    let Some(tenant) = shared.tenants.of(uid) else {
        return;
    };
    let mut client: Option<ClientId> = None;
    let hello_by = Instant::now() + shared.hello_timeout;
    while !shared.stop.load(Ordering::SeqCst) {
        let read = match client {
            None => read_frame_max(
                &mut Deadline {
                    stream,
                    until: hello_by,
                },
                MAX_HELLO_FRAME,
            ),
            Some(_) => {
                spin_readable(stream, shared.poll);
                read_frame(&mut &*stream)
            }
        };
        let req: Request = match read {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "kvtier node: connection ended");
                break;
            }
        };
        let attached = client.is_some();
        if attached {
            shared.requests.fetch_add(1, Ordering::Relaxed);
        }
        let reply = handle(shared, tenant, &mut client, req);
        if write_frame(&mut &*stream, &reply).is_err() {
            break;
        }
        if matches!(reply, Reply::Welcome { .. })
            && sock::send_fd(stream, tenant.arena.fd()).is_err()
        {
            break;
        }
        if !attached && client.is_some() && stream.set_read_timeout(Some(shared.idle)).is_err() {
            break;
        }
    }
    if let Some(id) = client {
        lock(&tenant.books).detach(id);
    }
}

/// One request of a connection of `tenant`'s uid.
fn handle(shared: &Shared, tenant: &Tenant, client: &mut Option<ClientId>, req: Request) -> Reply {
    let Some(id) = *client else {
        return match req {
            Request::Hello { version, namespace } => {
                hello(shared, tenant, client, version, namespace)
            }
            _ => Reply::Refused("the first message must be Hello".into()),
        };
    };
    let items = match &req {
        Request::Reserve { keys, .. } | Request::Lease(keys) => keys.len(),
        Request::Finish(v) => v.len(),
        Request::EndLeases(v) => v.len(),
        Request::Grant { count, .. } => *count as usize,
        _ => 0,
    };
    if items > MAX_BATCH {
        return Reply::Refused(format!(
            "a batch of {items} items exceeds this node's {MAX_BATCH}"
        ));
    }
    match req {
        Request::Hello { .. } => Reply::Refused("already attached".into()),
        Request::Finish(ends) => finish(shared, tenant, id, &ends),
        Request::Contains(keys) => {
            let books = lock(&tenant.books);
            let mut present = books.contains(id, &keys);
            if let (Some(d), Some(ns)) = (&shared.disk, books.namespace_of(id)) {
                let disk = lock(d);
                for (p, k) in present.iter_mut().zip(&keys) {
                    *p = *p || disk.contains(disk_key(ns, *k), None);
                }
            }
            Reply::Present(present)
        }
        Request::Reserve { bytes, .. } | Request::Grant { bytes, .. }
            if bytes == 0 || bytes > tenant.arena_bytes =>
        {
            Reply::Refused(format!(
                "a block of {bytes} bytes does not fit this node's {} bytes",
                tenant.arena_bytes
            ))
        }
        Request::Reserve { bytes, keys } => {
            let mut books = lock(&tenant.books);
            let answers = keys
                .iter()
                .map(|&key| match books.begin_put(id, key, bytes) {
                    Ok(g) => PutAnswer::Slot {
                        id: g.id,
                        offset: g.offset,
                    },
                    Err(PutRefused::Present) => PutAnswer::Present,
                    Err(PutRefused::Full) => PutAnswer::Full,
                })
                .collect();
            // Before the reply: no writer knows the evicted blocks' slots yet.
            spill_evicted(shared, tenant, &mut books);
            Reply::Reserved(answers)
        }
        Request::Grant { bytes, count } => {
            let mut books = lock(&tenant.books);
            let granted = (0..count)
                .map_while(|_| books.grant(id, bytes).ok())
                .map(|g| (g.id, g.offset))
                .collect();
            // As for `Reserve`: evicted blocks leave for the disk before a writer knows a slot.
            spill_evicted(shared, tenant, &mut books);
            Reply::Granted(granted)
        }
        Request::Lease(keys) => {
            let mut books = lock(&tenant.books);
            let answers = keys
                .iter()
                .map(|&key| {
                    match books
                        .begin_get(id, key)
                        .or_else(|| promote(shared, tenant, &mut books, id, key))
                    {
                        Some(g) => GetAnswer::Lease {
                            id: g.id,
                            offset: g.offset,
                            bytes: g.bytes,
                            checksum: g.checksum,
                        },
                        None => GetAnswer::Missing,
                    }
                })
                .collect();
            Reply::Leased(answers)
        }
        Request::EndLeases(ends) => {
            let mut books = lock(&tenant.books);
            let answers = ends
                .iter()
                .map(|end| {
                    let held = match *end {
                        LeaseEnd::Done(lease) => books.end_get(id, lease),
                        LeaseEnd::Damaged(lease) => {
                            let held = books.drop_block(id, lease);
                            if held {
                                kvtier::warn_limited!(
                                    lease,
                                    "kvtier node: a client found a damaged block; dropped"
                                );
                            }
                            held
                        }
                    };
                    if held {
                        ItemAnswer::Done
                    } else {
                        ItemAnswer::Unknown
                    }
                })
                .collect();
            Reply::Items(answers)
        }
        Request::Stats => stats_reply(&stats(shared)),
    }
}

/// `Hello`: the version and the namespace are checked, the client attached and welcomed.
fn hello(
    shared: &Shared,
    tenant: &Tenant,
    client: &mut Option<ClientId>,
    version: u32,
    namespace: String,
) -> Reply {
    if version != NODE_PROTOCOL_VERSION {
        return Reply::Refused(format!(
            "this kvtier node speaks node protocol {NODE_PROTOCOL_VERSION}, the engine's \
             kvtier speaks {version}: run a node and engines of the same kvtier version"
        ));
    }
    if namespace.is_empty() || namespace.len() > shared.max_namespace_len {
        return Reply::Refused(format!(
            "a namespace must have 1 to {} bytes, not {}",
            shared.max_namespace_len,
            namespace.len()
        ));
    }
    match lock(&tenant.books).attach(tenant.uid, &namespace) {
        Ok(c) => *client = Some(c),
        Err(e) => return Reply::Refused(e.to_string()),
    }
    Reply::Welcome {
        arena_bytes: tenant.arena_bytes,
        // This uid's arena: no other uid's process can write it (`tenants.rs`).
        private: true,
    }
}

/// `Finish`: aborts are applied and reservations looked up under the books' lock; the slots
/// committed with a checksum are hashed by the node in parallel outside it (they are this
/// client's reservations: no one else is handed them meanwhile, and only this connection's
/// thread can end them); then, under one lock again, each is published only if its bytes
/// match its checksum (otherwise dropped). A commit without a checksum is published as
/// written (the arena's writers are of one uid). One answer per item, in order.
fn finish(shared: &Shared, tenant: &Tenant, client: ClientId, ends: &[PutEnd]) -> Reply {
    let mut answers = vec![ItemAnswer::Done; ends.len()];
    // (answer index, reservation id, checksum committed) of the commits to verify.
    let mut check: Vec<(usize, u64, u64)> = Vec::new();
    let mut slots = Vec::new();
    {
        let mut books = lock(&tenant.books);
        for (i, end) in ends.iter().enumerate() {
            let (put, checksum) = match *end {
                PutEnd::Abort(put) => {
                    // Another connection's reservation is no more this one's to end than to
                    // commit: unknown, and left alone.
                    if !books.abort_put(client, put) {
                        answers[i] = ItemAnswer::Unknown;
                    }
                    continue;
                }
                PutEnd::Commit { id, checksum } => (id, checksum),
                PutEnd::Publish { id, key, checksum } => match books.name_grant(client, id, key) {
                    Named::Reserved => (id, checksum),
                    // Done: the node holds the key (the grant went back).
                    Named::Present => continue,
                    Named::Unknown => {
                        answers[i] = ItemAnswer::Unknown;
                        continue;
                    }
                },
            };
            let Some((key, offset, bytes)) = books.reservation(client, put) else {
                answers[i] = ItemAnswer::Unknown;
                continue;
            };
            match (checksum, usize::try_from(bytes)) {
                (Some(sum), Ok(n)) => {
                    check.push((i, put, sum));
                    slots.push((key, offset, n));
                }
                (None, _) => {
                    if !books.commit_put(client, put, None) {
                        answers[i] = ItemAnswer::Unknown;
                    }
                }
                (Some(_), Err(_)) => {
                    books.abort_put(client, put);
                    answers[i] = ItemAnswer::Mismatch;
                }
            }
        }
    }
    if check.is_empty() {
        return Reply::Items(answers);
    }
    let actual = slot_checksums(&tenant.arena, &slots);
    shared
        .verified
        .fetch_add(check.len() as u64, Ordering::Relaxed);
    let mut books = lock(&tenant.books);
    for ((i, put, sum), got) in check.into_iter().zip(actual) {
        if got.ok() != Some(sum) {
            books.abort_put(client, put);
            kvtier::warn_limited!(
                put,
                "kvtier node: a slot's bytes do not match the checksum committed; dropped"
            );
            answers[i] = ItemAnswer::Mismatch;
        } else if !books.commit_put(client, put, Some(sum)) {
            // The same reservation named twice in one batch: the first commit published it.
            answers[i] = ItemAnswer::Unknown;
        }
    }
    Reply::Items(answers)
}

fn stats_reply(s: &NodeStats) -> Reply {
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
        requests: s.requests,
        verified: s.verified,
        bytes_granted: s.bytes_granted,
    }
}

/// Every tenant's books' counters, summed, plus the disk tier's.
fn stats(shared: &Shared) -> NodeStats {
    let mut s = NodeStats::default();
    for t in shared.tenants.iter() {
        s.add(&lock(&t.books).stats());
    }
    s.requests = shared.requests.load(Ordering::Relaxed);
    s.verified = shared.verified.load(Ordering::Relaxed);
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
fn spill_evicted(shared: &Shared, tenant: &Tenant, books: &mut Books) {
    let Some(d) = &shared.disk else { return };
    let evicted = books.take_evicted();
    if evicted.is_empty() {
        return;
    }
    let mut disk = lock(d);
    for b in &evicted {
        spill_one(&tenant.arena, &mut disk, b);
    }
}

/// Write one arena block to disk if its bytes still match the checksum its writer committed;
/// a block committed without one (a private node: its writers are trusted) is written as it
/// is. The disk tier then checksums the bytes it writes, bound to the disk key, and verifies
/// them on every read.
fn spill_one(arena: &Arena, disk: &mut NodeDisk, b: &BlockCopy) {
    let Ok(n) = usize::try_from(b.bytes) else {
        return;
    };
    let mut buf = vec![0u8; n];
    let good = arena.read(b.offset, &mut buf).is_ok()
        && b.checksum
            .is_none_or(|sum| block_checksum(b.key, &buf) == sum);
    if !good {
        tracing::warn!("kvtier node: a damaged arena block was not spilled");
        return;
    }
    disk.spill(disk_key(&b.namespace, b.key), &buf);
}

/// An arena miss served from the disk tier: the block is read (verified by the disk tier) into
/// a slot reserved for `client`, committed, then leased to it like any arena block.
fn promote(
    shared: &Shared,
    tenant: &Tenant,
    books: &mut Books,
    client: ClientId,
    key: u128,
) -> Option<SlotGrant> {
    let d = shared.disk.as_ref()?;
    let dkey = disk_key(books.namespace_of(client)?, key);
    let bytes = lock(d).block_bytes_of(dkey)?;
    let g = books.begin_put(client, key, bytes as u64);
    spill_evicted(shared, tenant, books);
    let g = g.ok()?;
    let mut buf = vec![0u8; bytes];
    let read = lock(d).read(dkey, &mut buf) && tenant.arena.write(g.offset, &buf).is_ok();
    if !read {
        books.abort_put(client, g.id);
        return None;
    }
    // Verified by the disk tier; committed with its checksum for a reader that verifies (one
    // of another uid than the node's: `client.rs`).
    books.commit_put(client, g.id, Some(block_checksum(key, &buf)));
    books.begin_get(client, key)
}
