//! [`RedisStore`]: the remote store on a Redis-protocol server (Redis, Valkey) or a Redis/Valkey
//! Cluster, through kvtier's own RESP client ([`super::wire`]; cluster routing, MOVED and ASK in
//! [`super::cluster`]). The `redis` crate only parses URLs.
//!
//! Invariants:
//! - every operation has a deadline `t`: `lookup_timeout` for `contains` (it runs on the
//!   engine's scheduling step) and `io_timeout` for `get`/`put`. Connecting waits at most
//!   `min(connect_timeout, t)`, and the whole exchange on the connection (handshake, request, every
//!   reply of a pipeline) at most `t` from its start, however the server drips bytes; the one
//!   retry (on a pooled connection the server closed) happens only after an error that is not a
//!   timeout. So a dead, stalled or dripping server turns an operation into
//!   `RemoteError::Unavailable` after at most `min(connect_timeout, t) + 2t`, never a hang (in
//!   cluster mode the one deadline also covers the slot-map refresh, every node's connect and
//!   every redirect);
//! - `get` reads the reply's length prefix first: a value that is not exactly one frame of the
//!   caller's block size is refused (`SizeMismatch`, `Short`, `Corrupt`) after reading at most its
//!   40-byte header, and a value of the right size is read straight into the caller's buffer; no
//!   reply makes the store allocate;
//! - a connection that saw any error is dropped, never reused (it may hold an unread reply), and
//!   the next operation on that slot reconnects;
//! - a circuit breaker ([`super::breaker`]) opens after a refused connection, or after
//!   `trip_after` consecutive missed deadlines, resets or protocol errors (a busy server that
//!   answers some operations late is not down): operations fail at once with `Unavailable` for
//!   `backoff`, then one probe is
//!   let through (the rest keep failing fast); each failed probe doubles the window up to
//!   `max_backoff`. While a server stays down, the store therefore spends at most one deadline
//!   per window, whatever the number of callers, blocks or pool connections;
//! - `get` returns bytes only after `frame::decode_into` checked header and tag (bound to the key
//!   and the namespace).
//!
//! Locking: `slots[i]` guards pooled connection `i` (`None` = not connected). An operation holds one
//! slot's lock for its whole round trip; `next` only spreads waiting threads over the slots. The
//! breaker's lock is never held across network I/O.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvtier::hash::SequenceHash;
use kvtier::transfer::{RemoteError, RemoteHealth, RemoteStore, TransferError};
use redis::ConnectionAddr;

use super::breaker::{Breaker, BreakerState, BreakerStats, Failure, Ticket};
use super::cluster::{key_slot, ClusterConn, NodeFailure, Redirect, Router};
use super::frame::{self, HEADER_LEN};
use super::key::Namespace;
use super::wire::{push_bulk, push_cmd, Addr, Deadline, WireConn, WireError};

/// Tunables of a [`RedisStore`]; the defaults suit a server on the same network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// Bound on establishing a connection (TCP connect + handshake). Default 1 s.
    pub connect_timeout: Duration,
    /// Bound on each socket read and write. Default 5 s.
    pub io_timeout: Duration,
    /// Connections kept open at most (one per concurrent operation). Default 8.
    pub pool_size: usize,
    /// Expiry of stored values (`SET ... PX`); `None` = rely on the server's eviction policy.
    pub ttl: Option<Duration>,
    /// Deadline of each socket read and write of `contains` (the lookup on the engine's step).
    /// Default 250 ms; at most `io_timeout` is used.
    pub lookup_timeout: Duration,
    /// How long operations fail fast after a connection-level failure (the circuit breaker's
    /// first window). Default 1 s; zero disables the breaker.
    pub backoff: Duration,
    /// The longest window the breaker's doubling reaches. Default 30 s.
    pub max_backoff: Duration,
    /// Consecutive missed deadlines, resets or protocol errors that open the breaker (a refused
    /// connection opens it at once). Default 3.
    pub trip_after: u32,
    /// The seed nodes of a Redis/Valkey Cluster (`redis://[userinfo@]host:port` each), as the
    /// one remote URL parser (`kvtier::config::RemoteTarget::parse`) splits them from
    /// `redis://h1:p1,h2:p2?cluster=1`. Empty (the default): the URL names one server.
    pub cluster_seeds: Vec<String>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            pool_size: 8,
            ttl: None,
            lookup_timeout: Duration::from_millis(250),
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            trip_after: 3,
            cluster_seeds: Vec::new(),
        }
    }
}

/// A content-addressed block store on a Redis-protocol server. See the module docs.
pub struct RedisStore {
    client: Client,
    ns: Namespace,
    seal: frame::FrameSeal,
    opts: RedisOptions,
    slots: Box<[Mutex<Option<Conn>>]>,
    next: AtomicUsize,
    breaker: Breaker,
    /// Operations that failed on a timeout (connect, read or write past its deadline).
    deadline_expired: AtomicU64,
}

/// One server: where it listens and the handshake of each new connection.
struct Server {
    addr: Addr,
    /// `AUTH [user] password`.
    auth: Option<(Option<String>, String)>,
    db: i64,
}

enum Client {
    Single(Server),
    Cluster(Router),
}

/// One pooled connection: to a single server (with a reusable buffer for packed commands), or to
/// every node of a cluster.
enum Conn {
    Single { conn: WireConn, buf: Vec<u8> },
    Cluster(ClusterConn),
}

/// Why one attempt failed.
enum OpError {
    /// On the connection (to the server, or to one node of the cluster).
    Wire(WireError),
    /// The server answered, with a value that is not the frame asked for (the connection may
    /// hold the rest of it).
    Value(RemoteError),
}

impl From<WireError> for OpError {
    fn from(e: WireError) -> Self {
        OpError::Wire(e)
    }
}

impl OpError {
    fn is_timeout(&self) -> bool {
        match self {
            OpError::Wire(e) => e.is_timeout(),
            OpError::Value(_) => false,
        }
    }

    /// A broken connection (not a timeout): the one case worth a retry on a fresh connection.
    fn is_broken(&self) -> bool {
        match self {
            OpError::Wire(e) => matches!(e, WireError::Io(_)),
            OpError::Value(_) => false,
        }
    }

    /// What the failure says about the server.
    fn verdict(&self) -> Verdict {
        match self {
            OpError::Wire(WireError::Refused(_)) => Verdict::Down(Failure::Refused),
            OpError::Wire(WireError::Server(_) | WireError::NodeDown(_)) | OpError::Value(_) => {
                Verdict::Answered
            }
            OpError::Wire(_) => Verdict::Down(Failure::Failed),
        }
    }

    fn into_remote(self, op: &'static str) -> RemoteError {
        match self {
            OpError::Value(e) => e,
            OpError::Wire(e) => RemoteError::Unavailable {
                op,
                reason: e.to_string(),
            },
        }
    }

    /// How this error counts for a cluster node's breaker.
    fn node_failure(&self) -> NodeFailure {
        match self {
            OpError::Wire(e) => super::cluster::wire_failure(e),
            OpError::Value(_) => None,
        }
    }

    /// The cluster redirect this error is, if it is one.
    fn redirect(&self) -> Option<Redirect> {
        match self {
            OpError::Wire(WireError::Server(m)) => Redirect::parse(m),
            _ => None,
        }
    }
}

/// `SET name (header || payload) [PX ttl_ms]` as one RESP command in `out` (cleared first): the
/// payload is copied once, straight into the bytes that go on the wire.
fn pack_set(out: &mut Vec<u8>, name: &str, header: &[u8], payload: &[u8], ttl_ms: Option<u64>) {
    out.clear();
    out.reserve(header.len() + payload.len() + name.len() + 64);
    out.extend_from_slice(if ttl_ms.is_some() {
        b"*5\r\n"
    } else {
        b"*3\r\n"
    });
    push_bulk(out, &[b"SET"]);
    push_bulk(out, &[name.as_bytes()]);
    push_bulk(out, &[header, payload]);
    if let Some(ms) = ttl_ms {
        push_bulk(out, &[b"PX"]);
        push_bulk(out, &[ms.to_string().as_bytes()]);
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field(
                "addr",
                &match &self.client {
                    Client::Single(s) => format!("{:?}", s.addr),
                    Client::Cluster(_) => "cluster".to_string(),
                },
            )
            .field("ns", &self.ns)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// What a failed operation says about the server, for the circuit breaker.
enum Verdict {
    /// A connection-level failure (refused, reset, timeout, protocol error).
    Down(Failure),
    /// The server answered (an error reply).
    Answered,
    /// Not tried: the breaker opened while the operation waited for a connection.
    Withdrawn,
}

impl RedisStore {
    /// A store on the server at `url` (`redis://[user:pass@]host:port[/db]`, `valkey://…`,
    /// `redis+unix:///path`), or, with `opts.cluster_seeds`, on the cluster they seed (`url` then
    /// only names the store in messages). Connects lazily: a server that
    /// is down now only makes operations fail.
    pub fn open(url: &str, namespace: &str, opts: RedisOptions) -> Result<Self, RemoteError> {
        let ns = Namespace::new(namespace)?;
        if opts.pool_size == 0 {
            return Err(RemoteError::Config("pool_size must be at least 1".into()));
        }
        if opts.connect_timeout.is_zero()
            || opts.io_timeout.is_zero()
            || opts.lookup_timeout.is_zero()
        {
            return Err(RemoteError::Config("timeouts must be positive".into()));
        }
        if opts.ttl.is_some_and(|t| t.as_millis() == 0) {
            return Err(RemoteError::Config("ttl must be at least 1 ms".into()));
        }
        let shown = super::open::redact_url(url);
        let bad_url = |e: redis::RedisError| {
            // The crate's message may quote the URL: redact that too.
            let msg = e.to_string().replace(url, &shown);
            RemoteError::Config(format!("redis url {shown:?}: {msg}"))
        };
        // The crate parses the URL (address, credentials, database); kvtier's client talks.
        let parse = |url: &str| -> Result<Server, RemoteError> {
            let info = redis::Client::open(url)
                .map_err(bad_url)?
                .get_connection_info()
                .clone();
            let addr = match info.addr() {
                ConnectionAddr::Tcp(host, port) => Addr::Tcp(host.clone(), *port),
                ConnectionAddr::Unix(path) => Addr::Unix(path.clone()),
                _ => {
                    return Err(RemoteError::Config(format!(
                        "redis url {shown:?}: TLS is not compiled in"
                    )))
                }
            };
            let r = info.redis_settings();
            Ok(Server {
                addr,
                auth: r
                    .password()
                    .map(|p| (r.username().map(str::to_string), p.to_string())),
                db: r.db(),
            })
        };
        let client = if !opts.cluster_seeds.is_empty() {
            let seeds = opts
                .cluster_seeds
                .iter()
                .map(|s| parse(s))
                .collect::<Result<Vec<_>, _>>()?;
            if seeds.iter().any(|s| s.db != 0) {
                return Err(RemoteError::Config(format!(
                    "redis url {shown:?}: a cluster has only database 0"
                )));
            }
            let auth = seeds.iter().find_map(|s| s.auth.clone());
            Client::Cluster(Router::new(
                seeds.into_iter().map(|s| s.addr).collect(),
                auth,
                opts.connect_timeout,
                (opts.backoff, opts.max_backoff, opts.trip_after),
            ))
        } else {
            Client::Single(parse(url)?)
        };
        let slots = (0..opts.pool_size).map(|_| Mutex::new(None)).collect();
        // A cluster's nodes have a breaker each (`cluster::Router`): the store-wide one is off.
        let breaker = match client {
            Client::Cluster(_) => Breaker::new(Duration::ZERO, Duration::ZERO, 1),
            Client::Single(_) => Breaker::new(opts.backoff, opts.max_backoff, opts.trip_after),
        };
        Ok(RedisStore {
            client,
            seal: frame::FrameSeal::for_namespace(ns.as_str()),
            ns,
            slots,
            next: AtomicUsize::new(0),
            breaker,
            deadline_expired: AtomicU64::new(0),
            opts,
        })
    }

    /// Seals values with a keyed MAC under `secret` (see [`frame::FrameSeal::keyed`]).
    pub fn with_mac_key(mut self, secret: &[u8]) -> Result<Self, RemoteError> {
        self.seal = frame::FrameSeal::keyed(self.ns.as_str(), secret)?;
        Ok(self)
    }

    /// The namespace this store reads and writes.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// The circuit breaker's state and counters (a cluster's: its nodes' breakers as one, open
    /// when any node's is).
    pub fn breaker_stats(&self) -> BreakerStats {
        match &self.client {
            Client::Cluster(r) => r.breaker_stats(),
            Client::Single(_) => self.breaker.stats(),
        }
    }

    fn router(&self) -> Result<&Router, OpError> {
        match &self.client {
            Client::Cluster(r) => Ok(r),
            Client::Single(_) => Err(OpError::Wire(WireError::Protocol("not a cluster".into()))),
        }
    }

    fn lookup_deadline(&self) -> Duration {
        self.opts.lookup_timeout.min(self.opts.io_timeout)
    }

    /// One round trip to the server (connecting if needed).
    pub fn ping(&self) -> Result<(), RemoteError> {
        // In cluster mode: the node serving the empty key's slot (0).
        self.with_conn("ping", self.lookup_deadline(), |c, dl| {
            self.on_key(c, "", dl, |conn, buf, dl| {
                buf.clear();
                push_cmd(buf, &[b"PING"]);
                conn.send(buf, dl)?;
                Ok(conn.read_status(dl)?)
            })
        })
    }

    /// The lowest-numbered free slot (so a single thread keeps reusing one warm connection and
    /// its buffers), or, when all are busy, a wait on one chosen round-robin.
    fn lock_slot(&self) -> MutexGuard<'_, Option<Conn>> {
        let n = self.slots.len();
        for i in 0..n {
            match self.slots[i].try_lock() {
                Ok(g) => return g,
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    // A panic elsewhere while holding the slot: its connection state is unknown.
                    let mut g = p.into_inner();
                    *g = None;
                    return g;
                }
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        self.slots[start % n].lock().unwrap_or_else(|p| {
            let mut g = p.into_inner();
            *g = None;
            g
        })
    }

    /// A new connection, within `min(connect_timeout, t)`; its handshake runs under the first
    /// operation's deadline.
    fn connect(&self, t: Duration) -> Result<Conn, OpError> {
        match &self.client {
            Client::Single(server) => {
                let conn = WireConn::connect(
                    &server.addr,
                    self.opts.connect_timeout,
                    &Deadline::after(t),
                )?;
                Ok(Conn::Single {
                    conn,
                    buf: Vec::new(),
                })
            }
            // Nodes are connected on first use, under the operation's deadline.
            Client::Cluster(_) => Ok(Conn::Cluster(ClusterConn::default())),
        }
    }

    /// The handshake of a new single-server connection (`AUTH`, `SELECT`), under `dl`.
    fn handshake(&self, conn: &mut WireConn, dl: &Deadline) -> Result<(), OpError> {
        let Client::Single(server) = &self.client else {
            return Ok(());
        };
        let mut cmd = Vec::new();
        if let Some((user, pass)) = &server.auth {
            match user {
                Some(u) => push_cmd(&mut cmd, &[b"AUTH", u.as_bytes(), pass.as_bytes()]),
                None => push_cmd(&mut cmd, &[b"AUTH", pass.as_bytes()]),
            }
        }
        if server.db != 0 {
            push_cmd(&mut cmd, &[b"SELECT", server.db.to_string().as_bytes()]);
        }
        if cmd.is_empty() {
            return Ok(());
        }
        conn.send(&cmd, dl)?;
        if server.auth.is_some() {
            conn.read_status(dl)?;
        }
        if server.db != 0 {
            conn.read_status(dl)?;
        }
        Ok(())
    }

    /// Runs `f` on a pooled connection with deadline `t`, through the circuit breaker.
    fn with_conn<T>(
        &self,
        op: &'static str,
        t: Duration,
        f: impl FnMut(&mut Conn, &Deadline) -> Result<T, OpError>,
    ) -> Result<T, RemoteError> {
        let ticket = self
            .breaker
            .admit()
            .map_err(|r| RemoteError::Unavailable { op, reason: r.0 })?;
        match self.attempt(op, t, &ticket, f) {
            Ok(v) => {
                ticket.success();
                Ok(v)
            }
            Err((e, Verdict::Down(how))) => {
                ticket.failure(e.to_string(), how);
                Err(e)
            }
            Err((e, Verdict::Answered)) => {
                // The server answered (an error reply): it is up.
                ticket.success();
                Err(e)
            }
            Err((e, Verdict::Withdrawn)) => {
                ticket.withdraw();
                Err(e)
            }
        }
    }

    /// One operation with at most one reconnect (see the module invariants). The flag says whether
    /// the failure concerns the connection (as opposed to a server error reply).
    fn attempt<T>(
        &self,
        op: &'static str,
        t: Duration,
        ticket: &Ticket<'_>,
        mut f: impl FnMut(&mut Conn, &Deadline) -> Result<T, OpError>,
    ) -> Result<T, (RemoteError, Verdict)> {
        let mut slot = self.lock_slot();
        if !ticket.still_admitted() {
            return Err((
                RemoteError::Unavailable {
                    op,
                    reason: "server marked down while waiting for a connection".into(),
                },
                Verdict::Withdrawn,
            ));
        }
        let fail = |e: OpError| {
            if e.is_timeout() {
                self.deadline_expired.fetch_add(1, Ordering::Relaxed);
            }
            let verdict = e.verdict();
            (e.into_remote(op), verdict)
        };
        for attempt in 0..2 {
            let reused = slot.is_some();
            // One deadline for the whole exchange on this connection, handshake included; it
            // starts once connected (connecting has its own bound, `min(connect_timeout, t)`).
            let mut run = |slot: &mut Option<Conn>| -> Result<T, OpError> {
                let fresh = slot.is_none();
                let conn = match slot {
                    Some(c) => c,
                    None => slot.insert(self.connect(t)?),
                };
                let dl = Deadline::after(t);
                if let (Conn::Single { conn, .. }, true) = (&mut *conn, fresh) {
                    self.handshake(conn, &dl)?;
                }
                f(conn, &dl)
            };
            match run(&mut slot) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    *slot = None;
                    // A pooled connection may have been closed by the server (restart, idle
                    // timeout) since its last use: one retry on a fresh connection. Timeouts,
                    // protocol errors and server replies are not retried.
                    if !(reused && attempt == 0 && e.is_broken()) {
                        return Err(fail(e));
                    }
                    tracing::debug!(op, "stale redis connection, reconnecting");
                }
            }
        }
        Err((
            RemoteError::Unavailable {
                op,
                reason: "retry exhausted".into(),
            },
            Verdict::Down(Failure::Failed),
        ))
    }

    fn put_inner(&self, key: u128, data: &[u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let header = frame::encode_header(&self.seal, key, data);
        let ttl_ms = self
            .opts
            .ttl
            .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        self.with_conn("put", self.opts.io_timeout, |c, dl| {
            self.on_key(c, &rkey, dl, |conn, buf, dl| {
                pack_set(buf, &rkey, &header, data, ttl_ms);
                conn.send(buf, dl)?;
                Ok(conn.read_status(dl)?)
            })
        })
    }

    /// One exchange about `rkey`: on the single server's connection, or on the connection to the
    /// cluster node owning its slot (following redirects).
    fn on_key<T>(
        &self,
        c: &mut Conn,
        rkey: &str,
        dl: &Deadline,
        exchange: impl FnMut(&mut WireConn, &mut Vec<u8>, &Deadline) -> Result<T, OpError>,
    ) -> Result<T, OpError> {
        let mut exchange = exchange;
        match c {
            Conn::Single { conn, buf } => exchange(conn, buf, dl),
            Conn::Cluster(c) => c.single(
                self.router()?,
                key_slot(rkey.as_bytes()),
                dl,
                exchange,
                OpError::redirect,
                OpError::node_failure,
            ),
        }
    }

    fn get_inner(&self, key: u128, out: &mut [u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let found: Result<(), RemoteError> =
            self.with_conn("get", self.opts.io_timeout, |c, dl| {
                self.on_key(c, &rkey, dl, |conn, buf, dl| {
                    buf.clear();
                    push_cmd(buf, &[b"GET", rkey.as_bytes()]);
                    conn.send(buf, dl)?;
                    match conn.read_bulk_len(dl)? {
                        None => Ok(Err(RemoteError::Missing {
                            key: SequenceHash(key),
                        })),
                        Some(len) => read_frame(&self.seal, conn, dl, key, len, out),
                    }
                })
            })?;
        found
    }

    fn contains_inner(&self, keys: &[u128]) -> Result<Vec<bool>, RemoteError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<String> = keys.iter().map(|&k| self.ns.redis_key(k)).collect();
        let found: Vec<bool> =
            self.with_conn("contains", self.lookup_deadline(), |c, dl| match c {
                Conn::Single { conn, buf } => {
                    // One pipeline; every reply is read under the one deadline.
                    buf.clear();
                    for n in &names {
                        push_cmd(buf, &[b"EXISTS", n.as_bytes()]);
                    }
                    conn.send(buf, dl)?;
                    let mut found = Vec::with_capacity(names.len());
                    for _ in &names {
                        found.push(conn.read_int(dl)? > 0);
                    }
                    Ok(found)
                }
                // Keys live on different nodes: one pipeline per node.
                Conn::Cluster(c) => Ok(c.exists(self.router()?, &names, dl)?),
            })?;
        if found.len() != keys.len() {
            return Err(RemoteError::Unavailable {
                op: "contains",
                reason: format!("{} replies for {} keys", found.len(), keys.len()),
            });
        }
        Ok(found)
    }
}

/// Reads a `GET` reply of `len` bytes for `key` into `out`, checking `len` against the one frame
/// expected (header + `out.len()`) before reading more than its header: a value of another size
/// is refused without reading (or allocating) it, and the connection, which still holds the
/// rest, is then dropped by the caller (`OpError::Value`). A frame that was read whole but fails
/// its tag leaves the connection clean (`Ok(Err)`).
fn read_frame(
    seal: &frame::FrameSeal,
    conn: &mut WireConn,
    dl: &Deadline,
    key: u128,
    len: u64,
    out: &mut [u8],
) -> Result<Result<(), RemoteError>, OpError> {
    let expected = HEADER_LEN + out.len();
    let got = usize::try_from(len).unwrap_or(usize::MAX);
    if got < HEADER_LEN {
        return Err(OpError::Value(RemoteError::Short {
            key: SequenceHash(key),
            expected,
            got,
        }));
    }
    let mut head = [0u8; HEADER_LEN];
    conn.read_exact(&mut head, dl)?;
    let checked = frame::check_header(seal, key, &head, out.len());
    if got != expected {
        let e = match checked {
            Err(e) => e,
            Ok(_) if got < expected => RemoteError::Short {
                key: SequenceHash(key),
                expected,
                got,
            },
            Ok(_) => RemoteError::Corrupt {
                key: SequenceHash(key),
                reason: format!("{} trailing bytes", got - expected),
            },
        };
        return Err(OpError::Value(e));
    }
    let checked = checked.map_err(OpError::Value)?;
    conn.read_exact(out, dl)?;
    conn.read_crlf(dl)?;
    Ok(frame::verify_payload(seal, key, checked, out))
}

impl RemoteStore for RedisStore {
    fn put(&self, key: SequenceHash, data: &[u8]) -> Result<(), TransferError> {
        Ok(self.put_inner(key.0, data)?)
    }

    fn get(&self, key: SequenceHash, out: &mut [u8]) -> Result<(), TransferError> {
        Ok(self.get_inner(key.0, out)?)
    }

    fn contains(&self, keys: &[SequenceHash]) -> Result<Vec<bool>, TransferError> {
        let keys: Vec<u128> = keys.iter().map(|k| k.0).collect();
        Ok(self.contains_inner(&keys)?)
    }

    fn health(&self) -> RemoteHealth {
        let b = self.breaker_stats();
        RemoteHealth {
            breaker_open: b.state != BreakerState::Closed,
            breaker_opened: b.opened,
            breaker_probes: b.probes,
            short_circuited: b.short_circuited,
            deadline_expired: self.deadline_expired.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn packed_set_is_the_resp_the_crate_would_send() {
        let payload = vec![7u8; 1000];
        let header = [1u8; frame::HEADER_LEN];
        for ttl in [None, Some(1234u64)] {
            let mut ours = Vec::new();
            pack_set(&mut ours, "kvtier:v1:n:00ff", &header, &payload, ttl);
            let mut value = header.to_vec();
            value.extend_from_slice(&payload);
            let mut cmd = redis::cmd("SET");
            cmd.arg("kvtier:v1:n:00ff").arg(value);
            if let Some(ms) = ttl {
                cmd.arg("PX").arg(ms);
            }
            assert_eq!(ours, cmd.get_packed_command());
        }
    }
}
