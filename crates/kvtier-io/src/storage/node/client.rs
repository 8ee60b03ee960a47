//! [`NodeStore`]: an engine process's handle on the node tier, a
//! [`kvtier::transfer::RemoteStore`] whose bytes move through the node's shared arena (no copy
//! over the socket) and whose books are the node's.
//!
//! Invariants:
//! - a client attaches only to a node whose process runs as this uid or one of `node_uids`
//!   (checked with `SO_PEERCRED` before a byte is sent), and maps only the arena descriptor
//!   that node passed (`SCM_RIGHTS`) after checking it is a regular file of that uid, large
//!   enough and open read-write: it never opens a path a node names;
//! - a pooled connection the node has closed (idle timeout, protocol error) is seen closed
//!   before use and replaced, so it costs no `io_timeout` wait (one still owed `Grant` answers
//!   on their way is not idle; a close then shows in the reads that follow: `granted.rs`);
//! - a connection *verifies* unless its node said `Welcome { private: true }` (the arena it
//!   passed is written by no uid but this process's and the node's: every node of this version
//!   says so, with one arena per uid) and runs as this process's own uid (`SO_PEERCRED`), and
//!   `verify` is off: only then is every process that can write the arena of this user, whom the
//!   engine trusts anyway (docs/arch/node.md, Trust). A verifying
//!   connection commits each put with its checksum and accepts a read only when the bytes'
//!   checksum, bound to the key, matches what the writer committed; a mismatch drops the block
//!   at the node and is an error (the engine recomputes), never wrong bytes;
//! - a put becomes visible to other engines only after its bytes are in the arena (the commit
//!   follows the copy on the same connection); a put that fails midway is aborted, and one whose
//!   process dies is discarded by the node;
//! - every socket operation is bounded by `io_timeout`; a node that is down or stuck gives
//!   `RemoteError::Unavailable` (misses and skipped stores), never a hang; a full node gives a
//!   skipped store;
//! - a put or get is one round trip per phase (`Reserve`, `Finish`; `Lease`, `EndLeases`), a
//!   batch of one; the direct paths (`batch.rs`) batch a whole job per phase, and a direct store
//!   into slots granted ahead is one round trip (`granted.rs`);
//! - any reply that is not the one expected, with one answer per item, ends the connection
//!   (not pooled again; the node then drops its reservations and leases).
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtier::hash::SequenceHash;
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};

use super::granted::{self, Granted};
use super::protocol::{
    block_checksum, read_frame, spin_readable, write_frame, GetAnswer, ItemAnswer, LeaseEnd,
    PutAnswer, PutEnd, Reply, Request, CLIENT_SPIN, MAX_BATCH, NODE_PROTOCOL_VERSION,
};
use crate::sys::shm::Arena;
use crate::sys::sock;

/// Settings of a [`NodeStore`].
#[derive(Clone, Debug)]
pub struct NodeClientOptions {
    /// Bound on each socket read and write to the node (default 2 s).
    pub io_timeout: Duration,
    /// Connections kept open to the node (concurrent operations of this process).
    pub pool: usize,
    /// Users besides this process's own whose node it attaches to (`node_uid` in the
    /// `node://` URL); a listener of any other uid is refused.
    pub node_uids: Vec<u32>,
    /// A connection left unused this long gives the slots the node granted it back (default
    /// 5 s): an engine that stops storing does not keep arena space from the node's cache.
    pub grants_idle: Duration,
    /// Verify every block even on a node of this uid (`verify` in the `node://` URL): each
    /// put committed with the checksum of its private source, each get checked over its
    /// private copy. Against memory corruption; a hash pass per block on each side, and the
    /// staged path instead of direct DMA. Set it on every engine of a namespace: a verifying
    /// reader refuses a block committed without a checksum.
    pub verify: bool,
}

impl Default for NodeClientOptions {
    fn default() -> Self {
        NodeClientOptions {
            io_timeout: Duration::from_secs(2),
            pool: 4,
            grants_idle: Duration::from_secs(5),
            node_uids: Vec::new(),
            verify: false,
        }
    }
}

/// An arena's identity (device, inode): a restarted node has another.
type ArenaId = (u64, u64);

pub(super) struct Conn {
    stream: UnixStream,
    /// Hash what this connection stores and loads (see the module docs).
    pub(super) verify: bool,
    /// Time spent in round trips since the connection was last pooled.
    waited: std::time::Duration,
    /// Slots the node granted this connection for its next stores (`granted.rs`).
    pub(super) granted: Granted,
    /// When it was last handed back to the store's pool.
    pub(super) pooled_at: Instant,
}

/// The node tier as this process sees it (see the module docs).
pub struct NodeStore {
    socket: PathBuf,
    namespace: String,
    opts: NodeClientOptions,
    /// The node's arena and its identity (a restarted node has a new one, mapped on
    /// reconnect); `None` until the first connection succeeds.
    arena: RwLock<Option<(ArenaId, Arc<Arena>)>>,
    idle: Arc<Mutex<Vec<Conn>>>,
    /// Stops the thread that gives idle connections' grants back (`granted::spawn_returns`)
    /// when the store is dropped.
    _returns: Option<std::sync::mpsc::Sender<()>>,
    /// CUDA device whose context registers each arena mapping (set by a CUDA transfer engine).
    cuda: Mutex<Option<i32>>,
    /// Blocks this process hashed (stores committed with a checksum, loads verified).
    pub(super) hashed: AtomicU64,
    /// Nanoseconds spent in round trips on connections handed back to the pool.
    waited_ns: AtomicU64,
    /// Direct stores that went through granted slots (one round trip: `granted.rs`).
    pub(super) stores_granted: AtomicU64,
}

impl std::fmt::Debug for NodeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeStore")
            .field("socket", &self.socket)
            .field("namespace", &self.namespace)
            .finish()
    }
}

fn unavailable(op: &'static str, e: impl std::fmt::Display) -> RemoteError {
    RemoteError::Unavailable {
        op,
        reason: e.to_string(),
    }
}

/// A new connection's `Welcome`: the arena's descriptor, its bytes and the node's uid.
struct Welcome {
    fd: OwnedFd,
    bytes: u64,
    node_uid: u32,
}

fn unexpected(op: &'static str, reply: &Reply) -> RemoteError {
    let shown = format!("{reply:?}");
    let cut: String = shown.chars().take(200).collect();
    unavailable(op, format!("unexpected reply {cut}"))
}

fn hello(
    socket: &Path,
    namespace: &str,
    opts: &NodeClientOptions,
) -> Result<(Conn, Welcome), RemoteError> {
    let stream = UnixStream::connect(socket)
        .map_err(|e| unavailable("connect", format!("{}: {e}", socket.display())))?;
    let node_uid = sock::peer_uid(&stream).map_err(|e| unavailable("connect", e))?;
    if node_uid != sock::current_uid() && !opts.node_uids.contains(&node_uid) {
        return Err(RemoteError::Config(format!(
            "the process listening on {} runs as uid {node_uid}, not this engine's uid {} nor \
             an allowed node_uid: refused",
            socket.display(),
            sock::current_uid()
        )));
    }
    stream
        .set_read_timeout(Some(opts.io_timeout))
        .and_then(|()| stream.set_write_timeout(Some(opts.io_timeout)))
        .map_err(|e| unavailable("connect", e))?;
    let mut conn = Conn {
        stream,
        verify: true,
        waited: std::time::Duration::ZERO,
        granted: Granted::default(),
        pooled_at: Instant::now(),
    };
    let reply = conn.call(&Request::Hello {
        version: NODE_PROTOCOL_VERSION,
        namespace: namespace.to_owned(),
    })?;
    match reply {
        Reply::Welcome {
            arena_bytes,
            private,
        } => {
            // A node of another uid is never trusted as private, whatever it says.
            conn.verify = opts.verify || !(private && node_uid == sock::current_uid());
            conn.granted.arena_bytes = arena_bytes;
            let fd = sock::recv_fd(&conn.stream).map_err(|e| unavailable("hello", e))?;
            let w = Welcome {
                fd,
                bytes: arena_bytes,
                node_uid,
            };
            Ok((conn, w))
        }
        Reply::Refused(why) => Err(RemoteError::Config(format!(
            "the kvtier node at {} refused this engine: {why}",
            socket.display()
        ))),
        other => Err(unexpected("hello", &other)),
    }
}

fn map_arena(w: Welcome) -> Result<Arena, RemoteError> {
    let len = usize::try_from(w.bytes)
        .map_err(|_| RemoteError::Config("the node's arena does not fit this process".into()))?;
    // A node of another uid could truncate an unsealed arena under this mapping (SIGBUS).
    let sealed = w.node_uid != sock::current_uid();
    Arena::from_fd(w.fd, len, w.node_uid, sealed)
        .map_err(|e| RemoteError::Config(format!("cannot map the node's arena: {e}")))
}

/// The identity of the arena behind `fd`.
fn arena_id(fd: &OwnedFd) -> Result<ArenaId, RemoteError> {
    let f = fd
        .try_clone()
        .map(std::fs::File::from)
        .map_err(|e| unavailable("hello", e))?;
    let m = f.metadata().map_err(|e| unavailable("hello", e))?;
    Ok((m.dev(), m.ino()))
}

impl Conn {
    fn call(&mut self, req: &Request) -> Result<Reply, RemoteError> {
        self.send(req)?;
        self.recv()
    }

    /// Send `req` without reading its answer: the node answers a connection's requests in the
    /// order they came, so a caller may send the next request before it reads this one's
    /// answer ([`Self::recv`]), and the node works on it meanwhile.
    pub(super) fn send(&mut self, req: &Request) -> Result<(), RemoteError> {
        let t = std::time::Instant::now();
        let out = write_frame(&mut self.stream, req).map_err(|e| unavailable("send", e));
        self.waited += t.elapsed();
        out
    }

    /// The answer to the oldest request sent and not answered yet, after the answers to the
    /// `Grant`s sent before it (their slots join the pool).
    pub(super) fn recv(&mut self) -> Result<Reply, RemoteError> {
        self.settle()?;
        self.read_reply()
    }

    /// Read the answers to the `Grant`s sent and not answered yet: their slots join the pool.
    pub(super) fn settle(&mut self) -> Result<(), RemoteError> {
        self.settle_while(|_| true)
    }

    /// As [`Self::settle`], only the answers that have started to arrive: a connection the node
    /// closed is an error, one whose answers are still on their way is left owing them.
    pub(super) fn settle_arrived(&mut self) -> Result<(), RemoteError> {
        self.settle_while(sock::readable_now)
    }

    fn settle_while(&mut self, go: impl Fn(&UnixStream) -> bool) -> Result<(), RemoteError> {
        while self.granted.owes() && go(&self.stream) {
            let mut reply = self.read_reply()?;
            if !self.granted.take_reply(&mut reply) {
                return Err(unexpected("grant", &reply));
            }
        }
        Ok(())
    }

    fn read_reply(&mut self) -> Result<Reply, RemoteError> {
        let t = std::time::Instant::now();
        spin_readable(&self.stream, CLIENT_SPIN);
        let out = match read_frame(&mut self.stream) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(unavailable("receive", "the node closed the connection")),
            Err(e) => Err(unavailable("receive", e)),
        };
        self.waited += t.elapsed();
        out
    }

    /// The answer to one batch request of `n` items sent earlier, checked to be one answer per
    /// item: anything else is an error that ends the connection.
    pub(super) fn recv_items<A>(
        &mut self,
        op: &'static str,
        n: usize,
        answers: impl Fn(&mut Reply) -> Option<Vec<A>>,
    ) -> Result<Vec<A>, RemoteError> {
        let mut reply = self.recv()?;
        match answers(&mut reply) {
            Some(v) if v.len() == n => Ok(v),
            Some(v) => Err(unavailable(
                op,
                format!("{} answers to {} items", v.len(), n),
            )),
            None => Err(unexpected(op, &reply)),
        }
    }

    /// `items` in requests of at most [`MAX_BATCH`] (one round trip each), the answers of each
    /// checked to be one per item: anything else is an error that ends the connection.
    fn batch<I: Clone, A>(
        &mut self,
        op: &'static str,
        items: &[I],
        request: impl Fn(Vec<I>) -> Request,
        answers: impl Fn(&mut Reply) -> Option<Vec<A>>,
    ) -> Result<Vec<A>, RemoteError> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(MAX_BATCH) {
            self.send(&request(chunk.to_vec()))?;
            out.extend(self.recv_items(op, chunk.len(), &answers)?);
        }
        Ok(out)
    }

    /// Reserve a slot of `bytes` for each key.
    pub(super) fn reserve(
        &mut self,
        bytes: u64,
        keys: &[u128],
    ) -> Result<Vec<PutAnswer>, RemoteError> {
        self.batch(
            "reserve",
            keys,
            |keys| Request::Reserve { bytes, keys },
            |r| match r {
                Reply::Reserved(v) => Some(std::mem::take(v)),
                _ => None,
            },
        )
    }

    /// Commit or abort reservations.
    pub(super) fn finish(&mut self, ends: &[PutEnd]) -> Result<Vec<ItemAnswer>, RemoteError> {
        self.batch("finish", ends, Request::Finish, |r| match r {
            Reply::Items(v) => Some(std::mem::take(v)),
            _ => None,
        })
    }

    /// Lease the blocks of `keys`.
    pub(super) fn lease(&mut self, keys: &[u128]) -> Result<Vec<GetAnswer>, RemoteError> {
        self.batch("lease", keys, Request::Lease, |r| match r {
            Reply::Leased(v) => Some(std::mem::take(v)),
            _ => None,
        })
    }

    /// End leases (or report them damaged).
    pub(super) fn end_leases(&mut self, ends: &[LeaseEnd]) -> Result<Vec<ItemAnswer>, RemoteError> {
        self.batch("end of lease", ends, Request::EndLeases, |r| match r {
            Reply::Items(v) => Some(std::mem::take(v)),
            _ => None,
        })
    }
}

impl NodeStore {
    /// Attach to the node at `socket` under `namespace` (the model identity: engines of other
    /// models never see these blocks). Fails when the node cannot be reached or refuses.
    pub fn connect(
        socket: &Path,
        namespace: &str,
        opts: NodeClientOptions,
    ) -> Result<NodeStore, RemoteError> {
        let store = NodeStore::lazy(socket, namespace, opts);
        let (c, _) = store.conn()?;
        store.pool(c);
        Ok(store)
    }

    /// A handle that attaches on first use (a node that is down at engine start only makes
    /// the first operations miss).
    pub fn lazy(socket: &Path, namespace: &str, opts: NodeClientOptions) -> NodeStore {
        let idle = Arc::new(Mutex::new(Vec::new()));
        let returns = granted::spawn_returns(Arc::downgrade(&idle), opts.grants_idle, opts.pool);
        NodeStore {
            socket: socket.to_owned(),
            namespace: namespace.to_owned(),
            opts,
            arena: RwLock::new(None),
            idle,
            _returns: returns,
            cuda: Mutex::new(None),
            hashed: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
            stores_granted: AtomicU64::new(0),
        }
    }

    /// Time this process spent waiting for the node's answers (sending a request until its
    /// reply arrived), on connections handed back after their operations: where a job's time
    /// goes besides its copies and checksums.
    pub fn round_trip_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }

    /// Blocks this process hashed so far (puts committed with a checksum, gets verified): none
    /// on a private node of its own uid.
    pub fn blocks_hashed(&self) -> u64 {
        self.hashed.load(Ordering::Relaxed)
    }

    /// Direct store jobs so far that copied into slots granted ahead and published them in one
    /// round trip (the others reserved by key first).
    pub fn stores_granted(&self) -> u64 {
        self.stores_granted.load(Ordering::Relaxed)
    }

    /// Register every arena this process maps (the current one, and a restarted node's) with
    /// CUDA device `ordinal` for direct DMA. Registration failures are logged; the transfer
    /// engine then stages GPU copies through its bounce buffer instead.
    pub fn use_cuda(&self, ordinal: i32) {
        *self.cuda.lock().unwrap_or_else(|p| p.into_inner()) = Some(ordinal);
        // The arena mapped so far (if any) is replaced by a registered mapping on next attach.
        let mut arena = self.arena.write().unwrap_or_else(|p| p.into_inner());
        if arena.as_ref().is_some_and(|(_, a)| !a.cuda_registered()) {
            *arena = None;
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Truncate the arena this process was passed to `len` bytes, as a hostile tenant would
    /// (tests only): refused for an arena the node sealed. Attaches first if needed.
    #[cfg(any(test, feature = "testing"))]
    pub fn truncate_arena(&self, len: u64) -> std::io::Result<()> {
        let (c, arena) = self.conn().map_err(std::io::Error::other)?;
        self.pool(c);
        arena.truncate_file(len)
    }

    /// Whether the arena mapped now is registered with CUDA (false before the first attach).
    pub fn arena_registered(&self) -> bool {
        self.arena
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|(_, a)| a.cuda_registered())
    }

    pub(super) fn pool(&self, mut c: Conn) {
        let ns = u64::try_from(std::mem::take(&mut c.waited).as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        c.pooled_at = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.opts.pool {
            idle.push(c);
        }
    }

    /// A pooled connection the node has not closed, or a new one; a node that restarted (a
    /// new arena) is remapped.
    pub(super) fn conn(&self) -> Result<(Conn, Arc<Arena>), RemoteError> {
        loop {
            let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some(mut c) = pooled else { break };
            // The answers it is owed that have arrived are read first (a node that closed it
            // fails that read); one still owing answers on their way is not idle, so not closed
            // for idleness, and any later read sees a close.
            if c.granted.owes() && c.settle_arrived().is_err() {
                continue;
            }
            if !c.granted.owes() && sock::readable_now(&c.stream) {
                continue; // closed by the node (idle timeout, error): dropped, never waited on
            }
            let arena = self.arena.read().unwrap_or_else(|p| p.into_inner());
            if let Some((_, a)) = arena.as_ref() {
                return Ok((c, Arc::clone(a)));
            }
        }
        let (c, welcome) = hello(&self.socket, &self.namespace, &self.opts)?;
        let id = arena_id(&welcome.fd)?;
        let mut arena = self.arena.write().unwrap_or_else(|p| p.into_inner());
        match arena.as_ref() {
            Some((known, a)) if *known == id => return Ok((c, Arc::clone(a))),
            Some(_) => {
                tracing::info!("kvtier node restarted; mapping its new arena");
                // Connections to the old node are dead.
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
            None => {}
        }
        let mut mapped = map_arena(welcome)?;
        let cuda = *self.cuda.lock().unwrap_or_else(|p| p.into_inner());
        // A verifying connection's jobs are staged (checksums of private bytes only: `staged.rs`),
        // so its process has no use for the arena pinned and registered.
        if let Some(ordinal) = cuda.filter(|_| !c.verify) {
            match mapped.register_cuda(ordinal) {
                Ok(()) => tracing::info!(ordinal, "node arena registered with CUDA"),
                Err(e) => {
                    tracing::warn!(
                        "node arena not registered with CUDA ({e}); GPU copies are staged"
                    )
                }
            }
        }
        let a = Arc::new(mapped);
        *arena = Some((id, Arc::clone(&a)));
        Ok((c, a))
    }

    /// Run `f` on a pooled connection; a connection that failed is dropped, not pooled.
    fn with_conn<T>(
        &self,
        f: impl FnOnce(&mut Conn, &Arena) -> Result<T, RemoteError>,
    ) -> Result<T, RemoteError> {
        let (mut c, arena) = self.conn()?;
        let out = f(&mut c, &arena);
        if !matches!(out, Err(RemoteError::Unavailable { .. })) {
            self.pool(c);
        }
        out
    }

    /// The node's counters, as `(name, value)` pairs.
    pub fn node_stats(&self) -> Result<Vec<(&'static str, u64)>, RemoteError> {
        match self.with_conn(|c, _| c.call(&Request::Stats))? {
            Reply::Stats {
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
            } => Ok(vec![
                ("clients", clients),
                ("blocks", blocks),
                ("bytes_used", bytes_used),
                ("capacity", capacity),
                ("puts", puts),
                ("puts_full", puts_full),
                ("gets", gets),
                ("get_misses", get_misses),
                ("evictions", evictions),
                ("abandoned_puts", abandoned_puts),
                ("disk_blocks", disk_blocks),
                ("disk_spills", disk_spills),
                ("disk_hits", disk_hits),
                ("requests", requests),
                ("verified", verified),
                ("bytes_granted", bytes_granted),
            ]),
            other => Err(unexpected("stats", &other)),
        }
    }
}

impl RemoteStore for NodeStore {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn put(&self, key: SequenceHash, data: &[u8]) -> Result<(), TransferError> {
        let key = key.0;
        Ok(self.with_conn(|c, arena| {
            let (id, offset) = match c.reserve(data.len() as u64, &[key])?.first() {
                Some(&PutAnswer::Slot { id, offset }) => (id, offset),
                // Someone stored it already: nothing to do.
                Some(PutAnswer::Present) => return Ok(()),
                _ => return Err(unavailable("put", "the kvtier node is full; store skipped")),
            };
            if let Err(e) = arena.write(offset, data) {
                c.finish(&[PutEnd::Abort(id)])?;
                return Err(unavailable("put", e));
            }
            let checksum = c.verify.then(|| {
                self.hashed.fetch_add(1, Ordering::Relaxed);
                block_checksum(key, data)
            });
            match c.finish(&[PutEnd::Commit { id, checksum }])?.first() {
                Some(ItemAnswer::Done) => Ok(()),
                other => Err(unavailable("put", format!("commit refused: {other:?}"))),
            }
        })?)
    }

    fn get(&self, key: SequenceHash, out: &mut [u8]) -> Result<(), TransferError> {
        let key = key.0;
        Ok(self.with_conn(|c, arena| {
            let (id, offset, checksum) = match c.lease(&[key])?.first() {
                Some(&GetAnswer::Lease {
                    id,
                    offset,
                    bytes,
                    checksum,
                }) => {
                    if bytes != out.len() as u64 {
                        c.end_leases(&[LeaseEnd::Done(id)])?;
                        return Err(RemoteError::SizeMismatch {
                            key: SequenceHash(key),
                            expected: out.len(),
                            stored: bytes as usize,
                        });
                    }
                    (id, offset, checksum)
                }
                _ => {
                    return Err(RemoteError::Missing {
                        key: SequenceHash(key),
                    })
                }
            };
            let copied = arena.read(offset, out);
            let good = copied.is_ok()
                && (!c.verify || {
                    self.hashed.fetch_add(1, Ordering::Relaxed);
                    checksum == Some(block_checksum(key, out))
                });
            // Damaged only when the bytes were read and failed their checksum (a block without
            // one, on a verifying connection, cannot be checked: refused, not dropped).
            let end = if copied.is_ok() && !good && checksum.is_some() {
                LeaseEnd::Damaged(id)
            } else {
                LeaseEnd::Done(id)
            };
            let held = c.end_leases(&[end])?;
            if let Err(e) = copied {
                return Err(unavailable("get", e));
            }
            if !good {
                return Err(RemoteError::Corrupt {
                    key: SequenceHash(key),
                    reason: "the node's copy does not match its checksum".into(),
                });
            }
            if held.first() != Some(&ItemAnswer::Done) {
                return Err(unavailable("get", "the lease ended before the copy did"));
            }
            Ok(())
        })?)
    }

    fn contains(&self, keys: &[SequenceHash]) -> Result<Vec<bool>, TransferError> {
        let keys: Vec<u128> = keys.iter().map(|k| k.0).collect();
        Ok(
            self.with_conn(|c, _| match c.call(&Request::Contains(keys.clone()))? {
                Reply::Present(v) if v.len() == keys.len() => Ok(v),
                other => Err(unexpected("contains", &other)),
            })?,
        )
    }
}
