//! [`RedisStore`]: the remote store on a Redis-protocol server (Redis, Valkey), through the `redis`
//! crate's synchronous connections.
//!
//! Invariants:
//! - every socket operation is bounded: connecting by `connect_timeout`, each read and write by
//!   `io_timeout`; an operation makes at most two attempts, so a dead or hung server turns into
//!   `RemoteError::Unavailable` after at most `2 * (connect_timeout + 2 * io_timeout)`, never a hang;
//! - a connection that saw any error is dropped, never reused (it may hold an unread reply), and
//!   the next operation on that slot reconnects;
//! - after a connection-level failure (refused, reset, timeout) the server is marked down for
//!   `backoff`: operations in that window fail at once with `Unavailable` instead of each waiting
//!   for its own timeout (a job of many blocks against a hung server fails in one timeout, not in
//!   one per block); the first operation after the window probes the server again;
//! - `get` returns bytes only after `frame::decode_into` checked header and checksum.
//!
//! Locking: `slots[i]` guards pooled connection `i` (`None` = not connected). An operation holds one
//! slot's lock for its whole round trip; `next` only spreads threads over the slots. `down` guards
//! the outage record and is never held across network I/O.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use redis::{Connection, RedisResult, RedisWrite, ToRedisArgs};

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
    /// How long operations fail fast after a connection-level failure. Default 1 s; zero disables.
    pub backoff: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            pool_size: 8,
            ttl: None,
            backoff: Duration::from_secs(1),
        }
    }
}

/// A content-addressed block store on a Redis-protocol server. See the module docs.
pub struct RedisStore {
    client: redis::Client,
    ns: Namespace,
    opts: RedisOptions,
    slots: Box<[Mutex<Option<Connection>>]>,
    next: AtomicUsize,
    down: Mutex<Option<Outage>>,
}

/// The last connection-level failure, while its backoff window lasts.
struct Outage {
    until: Instant,
    reason: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("addr", &self.client.get_connection_info().addr())
            .field("ns", &self.ns)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
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
    /// `redis+unix:///path`). Connects lazily: a server that is down now only makes operations fail.
    pub fn open(url: &str, namespace: &str, opts: RedisOptions) -> Result<Self, RemoteError> {
        let ns = Namespace::new(namespace)?;
        if opts.pool_size == 0 {
            return Err(RemoteError::Config("pool_size must be at least 1".into()));
        }
        if opts.connect_timeout.is_zero() || opts.io_timeout.is_zero() {
            return Err(RemoteError::Config("timeouts must be positive".into()));
        }
        if opts.ttl.is_some_and(|t| t.as_millis() == 0) {
            return Err(RemoteError::Config("ttl must be at least 1 ms".into()));
        }
        let client = redis::Client::open(url)
            .map_err(|e| RemoteError::Config(format!("redis url {url:?}: {e}")))?;
        let slots = (0..opts.pool_size).map(|_| Mutex::new(None)).collect();
        Ok(RedisStore {
            client,
            ns,
            opts,
            slots,
            next: AtomicUsize::new(0),
            down: Mutex::new(None),
        })
    }

    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// One round trip to the server (connecting if needed).
    pub fn ping(&self) -> Result<(), RemoteError> {
        self.with_conn("ping", |c| redis::cmd("PING").query::<String>(c).map(drop))
    }

    fn lock_slot(&self) -> MutexGuard<'_, Option<Connection>> {
        let n = self.slots.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            match self.slots[(start + i) % n].try_lock() {
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
        self.slots[start % n].lock().unwrap_or_else(|p| {
            let mut g = p.into_inner();
            *g = None;
            g
        })
    }

    fn connect(&self) -> RedisResult<Connection> {
        let c = self
            .client
            .get_connection_with_timeout(self.opts.connect_timeout)?;
        c.set_read_timeout(Some(self.opts.io_timeout))?;
        c.set_write_timeout(Some(self.opts.io_timeout))?;
        Ok(c)
    }

    fn down_record(&self) -> MutexGuard<'_, Option<Outage>> {
        self.down.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on a pooled connection, failing fast while the server is marked down.
    fn with_conn<T>(
        &self,
        op: &'static str,
        f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T, RemoteError> {
        if let Some(o) = self.down_record().as_ref() {
            if Instant::now() < o.until {
                return Err(RemoteError::Unavailable {
                    op,
                    reason: format!("server marked down after: {}", o.reason),
                });
            }
        }
        match self.attempt(op, f) {
            Ok(v) => {
                let mut down = self.down_record();
                if down.is_some() {
                    tracing::info!("remote redis server reachable again");
                    *down = None;
                }
                Ok(v)
            }
            Err((e, connection_level)) => {
                if connection_level && !self.opts.backoff.is_zero() {
                    tracing::warn!(op, error = %e, backoff = ?self.opts.backoff, "remote redis server marked down");
                    *self.down_record() = Some(Outage {
                        until: Instant::now() + self.opts.backoff,
                        reason: e.to_string(),
                    });
                }
                Err(e)
            }
        }
    }

    /// One operation with at most one reconnect (see the module invariants). The flag says whether
    /// the failure concerns the connection (as opposed to a server error reply).
    fn attempt<T>(
        &self,
        op: &'static str,
        mut f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T, (RemoteError, bool)> {
        let mut slot = self.lock_slot();
        for attempt in 0..2 {
            let reused = slot.is_some();
            let conn = match slot.as_mut() {
                Some(c) => c,
                None => slot.insert(self.connect().map_err(|e| (unavailable(op, &e), true))?),
            };
            match f(conn) {
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
                        let connection_level = e.is_io_error()
                            || e.is_timeout()
                            || e.is_connection_dropped()
                            || e.is_connection_refusal();
                        return Err((unavailable(op, &e), connection_level));
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
            true,
        ))
    }

    fn put_inner(&self, key: u128, data: &[u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let value = FramedValue {
            header: frame::encode_header(key, data),
            payload: data,
        };
        let mut cmd = redis::cmd("SET");
        cmd.arg(&rkey).arg(&value);
        if let Some(ttl) = self.opts.ttl {
            cmd.arg("PX")
                .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        }
        self.with_conn("put", |c| cmd.query::<()>(c))
    }

    fn get_inner(&self, key: u128, out: &mut [u8]) -> Result<(), RemoteError> {
        let rkey = self.ns.redis_key(key);
        let value: Option<Vec<u8>> =
            self.with_conn("get", |c| redis::cmd("GET").arg(&rkey).query(c))?;
        match value {
            None => Err(RemoteError::Missing { key }),
            Some(v) => frame::decode_into(key, &v, out),
        }
    }

    fn contains_inner(&self, keys: &[u128]) -> Result<Vec<bool>, RemoteError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for &k in keys {
            pipe.cmd("EXISTS").arg(self.ns.redis_key(k));
        }
        let found: Vec<bool> = self.with_conn("contains", |c| pipe.query(c))?;
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
}
