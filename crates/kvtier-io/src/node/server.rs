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

use super::books::{Books, ClientId, PutRefused};
use super::share::SharePolicy;
use super::protocol::{read_frame, write_frame, Reply, Request, NODE_PROTOCOL_VERSION};
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
}

impl NodeOptions {
    pub fn new(socket: impl Into<PathBuf>, capacity: u64) -> Self {
        NodeOptions {
            socket: socket.into(),
            capacity,
            shm_dir: PathBuf::from("/dev/shm"),
            allowed_uids: Vec::new(),
            idle_timeout: Duration::from_secs(3600),
            share: SharePolicy::Equal,
        }
    }
}

struct Shared {
    books: Mutex<Books>,
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
    _arena: Arena,
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
        let listener = UnixListener::bind(&opts.socket)?;
        std::fs::set_permissions(&opts.socket, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            books: Mutex::new(Books::with_policy(opts.capacity, opts.share.clone())),
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
            _arena: arena,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The node's counters.
    pub fn stats(&self) -> super::books::NodeStats {
        lock(&self.shared.books).stats()
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
                        tracing::warn!(uid = u, "kvtier node: refused a client of another user");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "kvtier node: refused a client without credentials");
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
                tracing::warn!(error = %e, "kvtier node: accept failed");
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
        Request::Contains(keys) => Reply::Present(books.contains(id, &keys)),
        Request::BeginPut { bytes, .. } if bytes == 0 || bytes > shared.arena_bytes => {
            Reply::Refused(format!(
                "a block of {bytes} bytes does not fit this node's {} bytes",
                shared.arena_bytes
            ))
        }
        Request::BeginPut { key, bytes } => match books.begin_put(id, key, bytes) {
            Ok(g) => Reply::PutSlot {
                id: g.id,
                offset: g.offset,
            },
            Err(PutRefused::Present) => Reply::AlreadyPresent,
            Err(PutRefused::Full) => Reply::Full,
        },
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
        Request::BeginGet(key) => match books.begin_get(id, key) {
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
            let s = books.stats();
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
            }
        }
    }
}
