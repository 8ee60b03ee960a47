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
//!   before use and replaced, so it costs no `io_timeout` wait;
//! - `get` fills the caller's buffer and accepts it only when its checksum, bound to the key,
//!   matches what the writer committed; a mismatch drops the block at the node and is an error
//!   (the engine recomputes), never wrong bytes;
//! - a put becomes visible to other engines only after its bytes are in the arena (the commit
//!   follows the copy on the same connection); a put that fails midway is aborted, and one whose
//!   process dies is discarded by the node;
//! - every socket operation is bounded by `io_timeout`; a node that is down or stuck gives
//!   `RemoteError::Unavailable` (misses and skipped stores), never a hang; a full node gives a
//!   skipped store;
//! - the direct paths ([`NodeStore::store_direct`], [`NodeStore::load_direct`], used by the
//!   transfer engine to copy device <-> arena slot with no staging copy) keep every reservation
//!   and lease of a job on one connection, verify a leased slot's checksum before its bytes are
//!   copied out, and count a pair done only when the node acknowledged its `CommitPut` or
//!   `EndGet`: a connection that dies midway (the node then detached this client, so the slot
//!   may be reused) fails the pairs still open, never reports them done.
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvtier::transfer::{RemoteError, RemoteStore, TransferError};

use super::protocol::{
    block_checksum, read_frame, write_frame, Reply, Request, NODE_PROTOCOL_VERSION,
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
}

impl Default for NodeClientOptions {
    fn default() -> Self {
        NodeClientOptions {
            io_timeout: Duration::from_secs(2),
            pool: 4,
            node_uids: Vec::new(),
        }
    }
}

/// An arena's identity (device, inode): a restarted node has another.
type ArenaId = (u64, u64);

struct Conn {
    stream: UnixStream,
}

/// The node tier as this process sees it (see the module docs).
pub struct NodeStore {
    socket: PathBuf,
    namespace: String,
    opts: NodeClientOptions,
    /// The node's arena and its identity (a restarted node has a new one, mapped on
    /// reconnect); `None` until the first connection succeeds.
    arena: RwLock<Option<(ArenaId, Arc<Arena>)>>,
    idle: Mutex<Vec<Conn>>,
    /// CUDA device whose context registers each arena mapping (set by a CUDA transfer engine).
    cuda: Mutex<Option<i32>>,
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
    let mut conn = Conn { stream };
    let reply = conn.call(&Request::Hello {
        version: NODE_PROTOCOL_VERSION,
        namespace: namespace.to_owned(),
    })?;
    match reply {
        Reply::Welcome { arena_bytes } => {
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
        other => Err(unavailable("hello", format!("unexpected reply {other:?}"))),
    }
}

fn map_arena(w: Welcome) -> Result<Arena, RemoteError> {
    let len = usize::try_from(w.bytes)
        .map_err(|_| RemoteError::Config("the node's arena does not fit this process".into()))?;
    Arena::from_fd(w.fd, len, w.node_uid)
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
        write_frame(&mut self.stream, req).map_err(|e| unavailable("send", e))?;
        match read_frame(&mut self.stream) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(unavailable("receive", "the node closed the connection")),
            Err(e) => Err(unavailable("receive", e)),
        }
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
        NodeStore {
            socket: socket.to_owned(),
            namespace: namespace.to_owned(),
            opts,
            arena: RwLock::new(None),
            idle: Mutex::new(Vec::new()),
            cuda: Mutex::new(None),
        }
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

    /// Whether the arena mapped now is registered with CUDA (false before the first attach).
    pub fn arena_registered(&self) -> bool {
        self.arena
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|(_, a)| a.cuda_registered())
    }

    fn pool(&self, c: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.opts.pool {
            idle.push(c);
        }
    }

    /// A pooled connection the node has not closed, or a new one; a node that restarted (a
    /// new arena) is remapped.
    fn conn(&self) -> Result<(Conn, Arc<Arena>), RemoteError> {
        loop {
            let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some(c) = pooled else { break };
            if sock::peer_closed(&c.stream) {
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
        if let Some(ordinal) = cuda {
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
            ]),
            other => Err(unavailable("stats", format!("unexpected reply {other:?}"))),
        }
    }
}

/// One pair of a direct job: done, or why not.
pub(crate) type PairResult = Result<(), String>;

/// Items a direct job's device leg copies: `(index into the job's keys, arena address)`;
/// the leg returns the indices it failed, with reasons.
pub(crate) type DeviceLeg<'a> = dyn FnOnce(&[(usize, usize)]) -> Vec<(usize, String)> + 'a;

impl NodeStore {
    /// A connection for a direct job of `n` pairs, or the job's early answer: every pair failed
    /// (the node is unreachable) or `None` (`need_cuda` and the arena is not registered with
    /// CUDA: the caller stages the job).
    fn direct_conn(
        &self,
        n: usize,
        need_cuda: bool,
    ) -> Result<(Conn, Arc<Arena>), Option<Vec<PairResult>>> {
        let (c, arena) = self
            .conn()
            .map_err(|e| Some(vec![Err(format!("node: {e}")); n]))?;
        if need_cuda && !arena.cuda_registered() {
            self.pool(c);
            return Err(None);
        }
        Ok((c, arena))
    }

    /// Device -> arena for `keys` (blocks of `bytes`): reserve a slot per key, let `copy` fill
    /// the slots, then commit each slot copied with the checksum of its arena bytes (or abort
    /// it). `None` when the direct path cannot serve this job (`need_cuda` and the arena is not
    /// registered with CUDA): the caller stages it instead. A key the node already holds is done
    /// without a copy; a full node fails the pair (the store is skipped).
    pub(crate) fn store_direct(
        &self,
        keys: &[u128],
        bytes: usize,
        need_cuda: bool,
        copy: Box<DeviceLeg<'_>>,
    ) -> Option<Vec<PairResult>> {
        let (mut c, arena) = match self.direct_conn(keys.len(), need_cuda) {
            Ok(x) => x,
            Err(early) => return early,
        };
        let mut b = DirectBatch::new(keys.len());
        let mut grants: Vec<(usize, u64, u64)> = Vec::new();
        let mut items: Vec<(usize, usize)> = Vec::new();
        for (k, &key) in keys.iter().enumerate() {
            if b.failed_by_break(k) {
                continue;
            }
            let req = Request::BeginPut {
                key,
                bytes: bytes as u64,
            };
            match b.call(&mut c, k, &req) {
                Some(Reply::PutSlot { id, offset }) => match arena.addr(offset, bytes) {
                    Ok(a) => {
                        grants.push((k, id, offset));
                        items.push((k, a));
                    }
                    Err(e) => {
                        b.out[k] = Err(format!("node slot: {e}"));
                        b.send(&mut c, &Request::AbortPut(id));
                    }
                },
                Some(Reply::AlreadyPresent) | None => {}
                Some(Reply::Full) => {
                    b.out[k] = Err("the kvtier node is full; store skipped".into())
                }
                Some(other) => b.out[k] = Err(format!("node put: unexpected reply {other:?}")),
            }
        }
        b.copy(&items, copy);
        for (k, id, offset) in grants {
            // After a break the node detached this connection: the reservation vanished there.
            if b.failed_by_break(k) {
                continue;
            }
            let req = if b.out[k].is_err() {
                Request::AbortPut(id)
            } else {
                match arena.checksum(keys[k], offset, bytes) {
                    Ok(checksum) => Request::CommitPut { id, checksum },
                    Err(e) => {
                        b.out[k] = Err(format!("node slot: {e}"));
                        Request::AbortPut(id)
                    }
                }
            };
            match b.call(&mut c, k, &req) {
                Some(Reply::Done) | None => {}
                Some(other) => b.out[k] = Err(format!("node commit refused: {other:?}")),
            }
        }
        Some(b.finish(self, c))
    }

    /// Arena -> device for `keys`: lease each block, verify its arena bytes against the
    /// checksum its writer committed (a mismatch drops it at the node), let `copy` move the
    /// verified slots to the device, then end the leases. A pair counts only when its lease was
    /// still held when its copy finished (the node acknowledged `EndGet`). `None` as in
    /// [`Self::store_direct`].
    pub(crate) fn load_direct(
        &self,
        keys: &[u128],
        bytes: usize,
        need_cuda: bool,
        copy: Box<DeviceLeg<'_>>,
    ) -> Option<Vec<PairResult>> {
        let (mut c, arena) = match self.direct_conn(keys.len(), need_cuda) {
            Ok(x) => x,
            Err(early) => return early,
        };
        let mut b = DirectBatch::new(keys.len());
        let mut leases: Vec<(usize, u64)> = Vec::new();
        let mut items: Vec<(usize, usize)> = Vec::new();
        for (k, &key) in keys.iter().enumerate() {
            if b.failed_by_break(k) {
                continue;
            }
            let (id, offset, stored, checksum) = match b.call(&mut c, k, &Request::BeginGet(key)) {
                Some(Reply::Lease {
                    id,
                    offset,
                    bytes,
                    checksum,
                }) => (id, offset, bytes, checksum),
                Some(Reply::Missing) => {
                    b.out[k] = Err(RemoteError::Missing { key }.to_string());
                    continue;
                }
                Some(other) => {
                    b.out[k] = Err(format!("node get: unexpected reply {other:?}"));
                    continue;
                }
                None => continue,
            };
            let verdict = if stored != bytes as u64 {
                Err((
                    Request::EndGet(id),
                    RemoteError::SizeMismatch {
                        key,
                        expected: bytes,
                        stored: stored as usize,
                    }
                    .to_string(),
                ))
            } else {
                match (
                    arena.addr(offset, bytes),
                    arena.checksum(key, offset, bytes),
                ) {
                    (Ok(a), Ok(sum)) if sum == checksum => Ok(a),
                    (Ok(_), Ok(_)) => Err((
                        Request::Damaged(id),
                        RemoteError::Corrupt {
                            key,
                            reason: "the node's copy does not match its checksum".into(),
                        }
                        .to_string(),
                    )),
                    (Err(e), _) | (_, Err(e)) => {
                        Err((Request::EndGet(id), format!("node slot: {e}")))
                    }
                }
            };
            match verdict {
                Ok(a) => {
                    leases.push((k, id));
                    items.push((k, a));
                }
                Err((end, why)) => {
                    b.out[k] = Err(why);
                    b.send(&mut c, &end);
                }
            }
        }
        b.copy(&items, copy);
        for (k, id) in leases {
            // After a break the lease may have ended while the copy ran: the bytes are not trusted.
            if b.failed_by_break(k) {
                continue;
            }
            match b.call(&mut c, k, &Request::EndGet(id)) {
                Some(Reply::Done) | None => {}
                Some(other) => b.out[k] = Err(format!("node end of lease: {other:?}")),
            }
        }
        Some(b.finish(self, c))
    }
}

/// One direct job's results, pair by pair, and whether its connection broke: after a transport
/// error every later pair fails with that reason, and the connection is not pooled again (the
/// node detached it, dropping its reservations and leases).
struct DirectBatch {
    out: Vec<PairResult>,
    broken: Option<String>,
}

impl DirectBatch {
    fn new(n: usize) -> Self {
        DirectBatch {
            out: vec![Ok(()); n],
            broken: None,
        }
    }

    /// Fails pair `k` with the connection's break, if it broke; true then.
    fn failed_by_break(&mut self, k: usize) -> bool {
        match &self.broken {
            Some(b) => {
                self.out[k] = Err(b.clone());
                true
            }
            None => false,
        }
    }

    /// `req` on behalf of pair `k`: a transport error breaks the batch and fails `k` (`None`).
    fn call(&mut self, c: &mut Conn, k: usize, req: &Request) -> Option<Reply> {
        match c.call(req) {
            Ok(reply) => Some(reply),
            Err(e) => {
                self.broken = Some(format!("node: {e}"));
                self.out[k] = Err(format!("node: {e}"));
                None
            }
        }
    }

    /// `req` for a pair already failed (an abort, an early end of lease): its reply is not
    /// needed, a transport error only breaks the batch.
    fn send(&mut self, c: &mut Conn, req: &Request) {
        if let Err(e) = c.call(req) {
            self.broken = Some(format!("node: {e}"));
        }
    }

    /// The device leg over `items` (none: no call), failing the pairs it reports.
    fn copy(&mut self, items: &[(usize, usize)], copy: Box<DeviceLeg<'_>>) {
        if items.is_empty() {
            return;
        }
        for (k, why) in copy(items) {
            if let Some(o) = self.out.get_mut(k) {
                *o = Err(why);
            }
        }
    }

    /// The results; `c` goes back to `store`'s pool unless it broke.
    fn finish(self, store: &NodeStore, c: Conn) -> Vec<PairResult> {
        if self.broken.is_none() {
            store.pool(c);
        }
        self.out
    }
}

impl RemoteStore for NodeStore {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn put(&self, key: u128, data: &[u8]) -> Result<(), TransferError> {
        Ok(self.with_conn(|c, arena| {
            let req = Request::BeginPut {
                key,
                bytes: data.len() as u64,
            };
            let (id, offset) = match c.call(&req)? {
                Reply::PutSlot { id, offset } => (id, offset),
                // Someone stored it already: nothing to do.
                Reply::AlreadyPresent => return Ok(()),
                Reply::Full => {
                    return Err(unavailable("put", "the kvtier node is full; store skipped"))
                }
                other => return Err(unavailable("put", format!("unexpected reply {other:?}"))),
            };
            if let Err(e) = arena.write(offset, data) {
                let _ = c.call(&Request::AbortPut(id));
                return Err(unavailable("put", e));
            }
            let checksum = block_checksum(key, data);
            match c.call(&Request::CommitPut { id, checksum })? {
                Reply::Done => Ok(()),
                other => Err(unavailable("put", format!("commit refused: {other:?}"))),
            }
        })?)
    }

    fn get(&self, key: u128, out: &mut [u8]) -> Result<(), TransferError> {
        Ok(self.with_conn(|c, arena| {
            let (id, offset, checksum) = match c.call(&Request::BeginGet(key))? {
                Reply::Lease {
                    id,
                    offset,
                    bytes,
                    checksum,
                } => {
                    if bytes != out.len() as u64 {
                        c.call(&Request::EndGet(id))?;
                        return Err(RemoteError::SizeMismatch {
                            key,
                            expected: out.len(),
                            stored: bytes as usize,
                        });
                    }
                    (id, offset, checksum)
                }
                Reply::Missing => return Err(RemoteError::Missing { key }),
                other => return Err(unavailable("get", format!("unexpected reply {other:?}"))),
            };
            let copied = arena.read(offset, out);
            let good = copied.is_ok() && block_checksum(key, out) == checksum;
            let end = if good {
                Request::EndGet(id)
            } else {
                Request::Damaged(id)
            };
            c.call(&end)?;
            if let Err(e) = copied {
                return Err(unavailable("get", e));
            }
            if !good {
                return Err(RemoteError::Corrupt {
                    key,
                    reason: "the node's copy does not match its checksum".into(),
                });
            }
            Ok(())
        })?)
    }

    fn contains(&self, keys: &[u128]) -> Result<Vec<bool>, TransferError> {
        Ok(
            self.with_conn(|c, _| match c.call(&Request::Contains(keys.to_vec()))? {
                Reply::Present(v) if v.len() == keys.len() => Ok(v),
                other => Err(unavailable(
                    "contains",
                    format!("unexpected reply {other:?}"),
                )),
            })?,
        )
    }
}
