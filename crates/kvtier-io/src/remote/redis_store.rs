//! [`RedisStore`]: the remote store on a Redis-protocol server (Redis, Valkey) or cluster, through
//! the `redis` crate's synchronous connections (`ClusterConnection` in cluster mode, which routes
//! each key to the node owning its slot and follows MOVED/ASK).
//!
//! Invariants:
//! - every operation has a deadline `t`: `lookup_timeout` for `contains` (it runs on the
//!   engine's scheduling step) and `io_timeout` for `get`/`put`. Connecting waits at most
//!   `min(connect_timeout, t)` and each socket read and write at most `t`; the one retry (on a
//!   pooled connection the server closed) happens only after an immediate error, never after a
//!   timeout. So a dead or stalled server turns an operation into `RemoteError::Unavailable`
//!   after at most `min(connect_timeout, t) + 2t` (in practice `t`: a stopped server accepts the
//!   connection and the request, then never answers), never a hang;
//! - a connection that saw any error is dropped, never reused (it may hold an unread reply), and
//!   the next operation on that slot reconnects;
//! - a circuit breaker ([`super::breaker`]) opens after a connection-level failure (refused,
//!   reset, timeout): operations fail at once with `Unavailable` for `backoff`, then one probe is
//!   let through (the rest keep failing fast); each failed probe doubles the window up to
//!   `max_backoff`. While a server stays down, the store therefore spends at most one deadline
//!   per window, whatever the number of callers, blocks or pool connections;
//! - `get` returns bytes only after `frame::decode_into` checked header and tag (bound to the key
//!   and the namespace).
//!
//! Locking: `slots[i]` guards pooled connection `i` (`None` = not connected). An operation holds one
//! slot's lock for its whole round trip; `next` only spreads waiting threads over the slots. `down` guards
//! the outage record and is never held across network I/O.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvtier::transfer::{RemoteError, RemoteHealth, RemoteStore, TransferError};
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{Connection, ConnectionLike, RedisResult, RedisWrite, ToRedisArgs};

use super::breaker::{Breaker, BreakerState, BreakerStats, Ticket};
use super::frame;
use super::key::Namespace;

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

enum Client {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// One pooled connection: to a single server (with a reusable buffer for packed `SET`s), or to
/// every node of a cluster.
enum Conn {
    Single {
        conn: Connection,
        buf: Vec<u8>,
        timeout: Duration,
    },
    Cluster {
        conn: Box<ClusterConnection>,
        timeout: Duration,
    },
}

impl Conn {
    /// Sets the socket read/write timeout to `t` (a no-op when it already is).
    fn set_deadline(&mut self, t: Duration) -> RedisResult<()> {
        match self {
            Conn::Single { conn, timeout, .. } if *timeout != t => {
                conn.set_read_timeout(Some(t))?;
                conn.set_write_timeout(Some(t))?;
                *timeout = t;
            }
            Conn::Cluster { conn, timeout } if *timeout != t => {
                conn.set_read_timeout(Some(t))?;
                conn.set_write_timeout(Some(t))?;
                *timeout = t;
            }
            _ => {}
        }
        Ok(())
    }

    fn as_dyn(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Single { conn, .. } => conn,
            Conn::Cluster { conn, .. } => conn.as_mut(),
        }
    }
}

/// Appends one RESP bulk string made of `parts` to `out`.
fn push_bulk(out: &mut Vec<u8>, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(b"\r\n");
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
                    Client::Single(c) => c.get_connection_info().addr().to_string(),
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
    /// A connection-level failure (refused, reset, timeout).
    Down,
    /// The server answered (an error reply).
    Answered,
    /// Not tried: the breaker opened while the operation waited for a connection.
    Withdrawn,
}

/// `header || payload` as one Redis argument, written straight into the command buffer.
struct FramedValue<'a> {
    header: [u8; frame::HEADER_LEN],
    payload: &'a [u8],
}

impl ToRedisArgs for FramedValue<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        // The writer appends to an in-memory Vec and cannot fail.
        let _ = w.write_all(&self.header);
        let _ = w.write_all(self.payload);
    }
}

fn unavailable(op: &'static str, e: &redis::RedisError) -> RemoteError {
    RemoteError::Unavailable {
        op,
        reason: e.to_string(),
    }
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
        let client = if !opts.cluster_seeds.is_empty() {
            let c = ClusterClient::builder(opts.cluster_seeds.clone())
                .connection_timeout(opts.connect_timeout)
                .response_timeout(opts.io_timeout)
                .retries(1)
                .build()
                .map_err(bad_url)?;
            Client::Cluster(c)
        } else {
            Client::Single(redis::Client::open(url).map_err(bad_url)?)
        };
        let slots = (0..opts.pool_size).map(|_| Mutex::new(None)).collect();
        Ok(RedisStore {
            client,
            seal: frame::FrameSeal::for_namespace(ns.as_str()),
            ns,
            slots,
            next: AtomicUsize::new(0),
            breaker: Breaker::new(opts.backoff, opts.max_backoff),
            deadline_expired: AtomicU64::new(0),
            opts,
        })
    }

    /// The namespace this store reads and writes.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// The circuit breaker's state and counters.
    pub fn breaker_stats(&self) -> BreakerStats {
        self.breaker.stats()
    }

    fn lookup_deadline(&self) -> Duration {
        self.opts.lookup_timeout.min(self.opts.io_timeout)
    }

    /// One round trip to the server (connecting if needed).
    pub fn ping(&self) -> Result<(), RemoteError> {
        self.with_conn("ping", self.lookup_deadline(), |c| {
            redis::cmd("PING").query::<String>(c.as_dyn()).map(drop)
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

    fn connect(&self, t: Duration) -> RedisResult<Conn> {
        let connect_timeout = self.opts.connect_timeout.min(t);
        match &self.client {
            Client::Single(client) => {
                let c = client.get_connection_with_timeout(connect_timeout)?;
                c.set_read_timeout(Some(t))?;
                c.set_write_timeout(Some(t))?;
                Ok(Conn::Single {
                    conn: c,
                    buf: Vec::new(),
                    timeout: t,
                })
            }
            Client::Cluster(client) => {
                let c = client.get_connection()?;
                c.set_read_timeout(Some(t))?;
                c.set_write_timeout(Some(t))?;
                Ok(Conn::Cluster {
                    conn: Box::new(c),
                    timeout: t,
                })
            }
        }
    }

    /// Runs `f` on a pooled connection with deadline `t`, through the circuit breaker.
    fn with_conn<T>(
        &self,
        op: &'static str,
        t: Duration,
        f: impl FnMut(&mut Conn) -> RedisResult<T>,
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
            Err((e, Verdict::Down)) => {
                ticket.failure(e.to_string());
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
        mut f: impl FnMut(&mut Conn) -> RedisResult<T>,
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
        for attempt in 0..2 {
            let reused = slot.is_some();
            let conn = match slot.as_mut() {
                Some(c) => c,
                None => slot.insert(self.connect(t).map_err(|e| {
                    if e.is_timeout() {
                        self.deadline_expired.fetch_add(1, Ordering::Relaxed);
                    }
                    (unavailable(op, &e), Verdict::Down)
                })?),
            };
            match conn.set_deadline(t).and_then(|()| f(conn)) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    *slot = None;
                    // A pooled connection may have been closed by the server (restart, idle
                    // timeout) since its last use: one retry on a fresh connection. Timeouts and
                    // server replies are not retried.
                    let stale = reused
                        && attempt == 0
                        && !e.is_timeout()
                        && (e.is_io_error() || e.is_connection_dropped());
                    if !stale {
                        tracing::debug!(op, error = %e, "remote redis operation failed");
                        if e.is_timeout() {
                            self.deadline_expired.fetch_add(1, Ordering::Relaxed);
                        }
                        let connection_level = e.is_io_error()
                            || e.is_timeout()
                            || e.is_connection_dropped()
                            || e.is_connection_refusal();
                        let verdict = if connection_level {
                            Verdict::Down
                        } else {
                            Verdict::Answered
                        };
                        return Err((unavailable(op, &e), verdict));
                    }
                    tracing::debug!(op, error = %e, "stale redis connection, reconnecting");
                }
            }
        }
        Err((
            RemoteError::Unavailable {
                op,
                reason: "retry exhausted".into(),
            },
            Verdict::Down,
        ))
    }

    fn put_inner(&self, key: u128, data: &[u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let header = frame::encode_header(&self.seal, key, data);
        let ttl_ms = self
            .opts
            .ttl
            .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        self.with_conn("put", self.opts.io_timeout, |c| match c {
            Conn::Single { conn, buf, .. } => {
                pack_set(buf, &rkey, &header, data, ttl_ms);
                let reply = conn.req_packed_command(buf)?;
                redis::from_redis_value::<()>(reply.extract_error()?).map_err(Into::into)
            }
            Conn::Cluster { conn: c, .. } => {
                // The cluster connection routes by parsing the command: give it a `Cmd`.
                let value = FramedValue {
                    header,
                    payload: data,
                };
                let mut cmd = redis::cmd("SET");
                cmd.arg(&rkey).arg(&value);
                if let Some(ms) = ttl_ms {
                    cmd.arg("PX").arg(ms);
                }
                cmd.query::<()>(c.as_mut())
            }
        })
    }

    fn get_inner(&self, key: u128, out: &mut [u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let value: Option<Vec<u8>> = self.with_conn("get", self.opts.io_timeout, |c| {
            redis::cmd("GET").arg(&rkey).query(c.as_dyn())
        })?;
        match value {
            None => Err(RemoteError::Missing { key }),
            Some(v) => frame::decode_into(&self.seal, key, &v, out),
        }
    }

    fn contains_inner(&self, keys: &[u128]) -> Result<Vec<bool>, RemoteError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<String> = keys.iter().map(|&k| self.ns.redis_key(k)).collect();
        let found: Vec<bool> = self.with_conn("contains", self.lookup_deadline(), |c| match c {
            Conn::Single { conn, .. } => {
                let mut pipe = redis::pipe();
                for n in &names {
                    pipe.cmd("EXISTS").arg(n);
                }
                pipe.query(conn)
            }
            Conn::Cluster { conn: c, .. } => {
                // Keys live on different nodes: the cluster pipeline groups them per node.
                let mut pipe = redis::cluster::cluster_pipe();
                for n in &names {
                    pipe.cmd("EXISTS").arg(n);
                }
                pipe.query(c)
            }
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

impl RemoteStore for RedisStore {
    fn put(&self, key: u128, data: &[u8]) -> Result<(), TransferError> {
        Ok(self.put_inner(key, data)?)
    }

    fn get(&self, key: u128, out: &mut [u8]) -> Result<(), TransferError> {
        Ok(self.get_inner(key, out)?)
    }

    fn contains(&self, keys: &[u128]) -> Result<Vec<bool>, TransferError> {
        Ok(self.contains_inner(keys)?)
    }

    fn health(&self) -> RemoteHealth {
        let b = self.breaker.stats();
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
