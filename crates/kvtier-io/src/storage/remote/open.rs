//! [`from_url`] and [`open`]: pick and configure a remote-store backend from one URL (the form used
//! in kvtier's configuration), parsed by the core's one parser ([`RemoteTarget::parse`]), so the
//! configuration check and the store accept exactly the same URLs.
//!
//! Invariant: a URL either yields a fully configured store or a `RemoteError::Config` naming what
//! was wrong; unknown kvtier options are rejected rather than ignored (a typo must not silently
//! disable a timeout).
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use kvtier::config::{RemoteBackend, RemoteTarget};
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};

use super::dir_store::{DirOptions, DirStore};
use super::frame::MIN_MAC_KEY_LEN;
use super::redis_store::{RedisOptions, RedisStore};
use crate::storage::node::{NodeClientOptions, NodeStore};

/// Opens the remote store named by `url`, with its keys in `namespace`.
///
/// Backends:
/// - `redis://[user:password@]host:port[/db]`, `valkey://…`, `redis+unix:///socket`,
///   `valkey+unix:///socket`, `unix:///socket` — a Redis or
///   Valkey server. Options (query string): `connect_timeout_ms` (default 1000), `io_timeout_ms`
///   (default 5000), `pool` (connections, default 8), `ttl_s` (expiry of values, default none),
///   `lookup_timeout_ms` (deadline of `contains`, the lookup on the engine's step, default 250),
///   `backoff_ms` (how long operations fail fast after a connection failure, default 1000, 0 = off;
///   each failed probe doubles it up to `max_backoff_ms`, default 30000),
///   `cluster=1` (Redis/Valkey Cluster: the hosts, comma-separated, are seed nodes:
///   `redis://h1:p1,h2:p2?cluster=1`);
///   the `redis` crate's own options (`protocol`; `db`, `user`, `pass` on a Unix socket) pass
///   through. `rediss://` (TLS) is refused: kvtier is built without the crate's TLS features.
/// - `dir:///absolute/path` — one file per key under the directory (shared storage). Option
///   `fsync=1` syncs each value before publishing it.
/// - `node:///absolute/socket` — the node tier of this machine (`kvtier node`): one host cache
///   shared by every engine process here, through shared memory. Options `io_timeout_ms`
///   (default 2000), `pool` (connections, default 4). Attaches lazily.
///
/// Keys are `kvtier:v<hash scheme>:<namespace>:<32 hex>` (Redis) or
/// `kvtier-v<hash scheme>/<namespace>/<2 hex>/<32 hex>` (directory). `namespace` must be 1..=64
/// characters of `[A-Za-z0-9_.-]`. Connections are made lazily: a server that is down makes
/// operations fail with `RemoteError::Unavailable`, not `from_url`.
///
/// ```
/// # fn main() -> Result<(), kvtier::transfer::TransferError> {
/// use kvtier::hash::SequenceHash;
/// let dir = std::env::temp_dir().join(format!("kvtier-doctest-{}", std::process::id()));
/// let store = kvtier_io::storage::remote::from_url(&format!("dir://{}", dir.display()), "docs")?;
/// store.put(SequenceHash(7), b"block bytes")?;
/// let mut out = [0u8; 11];
/// store.get(SequenceHash(7), &mut out)?;
/// assert_eq!(&out, b"block bytes");
/// let keys = [SequenceHash(7), SequenceHash(8)];
/// assert_eq!(store.contains(&keys)?, vec![true, false]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(()) }
/// ```
pub fn from_url(url: &str, namespace: &str) -> Result<Arc<dyn RemoteStore>, TransferError> {
    Ok(open_url(url, namespace)?)
}

/// Opens the store a parsed `remote.url` names (see [`from_url`]).
pub fn open(target: &RemoteTarget, namespace: &str) -> Result<Arc<dyn RemoteStore>, TransferError> {
    Ok(open_target(target, namespace)?)
}

pub use kvtier::config::redact_url;

/// The secret of `remote.mac_key_file`: the file's bytes less trailing whitespace (a final
/// newline). The error names the file, never its contents.
fn read_mac_key(path: &Path) -> Result<Vec<u8>, RemoteError> {
    let bad =
        |why: String| RemoteError::Config(format!("remote.mac_key_file {}: {why}", path.display()));
    let mut key = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    while key.last().is_some_and(u8::is_ascii_whitespace) {
        key.pop();
    }
    if key.len() < MIN_MAC_KEY_LEN {
        return Err(bad(format!(
            "holds {} bytes, at least {MIN_MAC_KEY_LEN} are needed (e.g. `head -c 32 /dev/urandom | base64`)",
            key.len()
        )));
    }
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            tracing::warn!(file = %path.display(), "remote.mac_key_file is readable by other users: chmod 600 it");
        }
    }
    Ok(key)
}

fn open_url(url: &str, namespace: &str) -> Result<Arc<dyn RemoteStore>, RemoteError> {
    let target = RemoteTarget::parse(url).map_err(|e| RemoteError::Config(e.to_string()))?;
    open_target(&target, namespace)
}

fn open_target(
    target: &RemoteTarget,
    namespace: &str,
) -> Result<Arc<dyn RemoteStore>, RemoteError> {
    match &target.backend {
        RemoteBackend::Dir { path, fsync } => {
            let opts = DirOptions { fsync: *fsync };
            let mut store = DirStore::open(path, namespace, opts)?;
            if let Some(f) = &target.mac_key_file {
                store = store.with_mac_key(&read_mac_key(f)?)?;
            }
            Ok(Arc::new(store))
        }
        RemoteBackend::Redis(r) => {
            let opts = RedisOptions {
                connect_timeout: r.connect_timeout,
                io_timeout: r.io_timeout,
                pool_size: r.pool_size,
                ttl: r.ttl,
                backoff: r.backoff,
                max_backoff: r.max_backoff,
                lookup_timeout: r.lookup_timeout,
                trip_after: r.trip_after,
                cluster_seeds: r.cluster_seeds.clone(),
            };
            // The redis crate reads the URL's address and its own options, ignoring kvtier's.
            let mut store = RedisStore::open(&target.url, namespace, opts)?;
            if let Some(f) = &target.mac_key_file {
                store = store.with_mac_key(&read_mac_key(f)?)?;
            }
            Ok(Arc::new(store))
        }
        RemoteBackend::Node {
            socket,
            io_timeout,
            pool,
            node_uids,
            verify,
        } => {
            let opts = NodeClientOptions {
                io_timeout: *io_timeout,
                pool: *pool,
                node_uids: node_uids.clone(),
                verify: *verify,
                ..NodeClientOptions::default()
            };
            Ok(Arc::new(NodeStore::lazy(socket, namespace, opts)))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn config_err(url: &str) -> String {
        match open_url(url, "t") {
            Err(RemoteError::Config(m)) => m,
            Err(e) => panic!("{url}: unexpected error {e}"),
            Ok(_) => panic!("{url}: accepted"),
        }
    }

    #[test]
    fn bad_urls_are_config_errors() {
        assert!(config_err("localhost:6379").contains("no scheme"));
        assert!(config_err("http://x").contains("unknown remote store scheme"));
        assert!(config_err("rediss://x:1").contains("TLS"));
        assert!(config_err("redis://127.0.0.1:1?io_timeout=5").contains("unknown option"));
        assert!(config_err("redis://127.0.0.1:1?pool=0").contains("pool_size"));
        assert!(config_err("redis://127.0.0.1:1?pool=x").contains("whole number"));
        assert!(config_err("redis://127.0.0.1:1?io_timeout_ms=0").contains("timeouts"));
        assert!(config_err("dir://relative/path").contains("absolute"));
        assert!(config_err("dir:///tmp/x?fsync=maybe").contains("fsync"));
        assert!(config_err("node://relative.sock").contains("absolute"));
        assert!(config_err("node:///x.sock?pool=0").contains("positive"));
        assert!(config_err("node:///x.sock?color=red").contains("unknown option"));
        assert!(matches!(
            open_url("redis://127.0.0.1:1", "bad/ns"),
            Err(RemoteError::Config(_))
        ));
    }

    /// The configuration check and the store accept the same URLs (#13: `rediss://` passed the
    /// check and failed in the store, `redis+unix://` the reverse).
    #[test]
    fn config_check_and_store_agree() {
        let dir = std::env::temp_dir().join(format!("kvtier-agree-{}", std::process::id()));
        let dir_url = format!("dir://{}", dir.display());
        for url in [
            "redis://127.0.0.1:1",
            "valkey://127.0.0.1:1/2?pool=1&protocol=resp3",
            "redis+unix:///tmp/kvtier-none.sock?db=1",
            "valkey+unix:///tmp/kvtier-none.sock",
            "unix:///tmp/kvtier-none.sock",
            "redis://127.0.0.1:1,127.0.0.1:2?cluster=1",
            dir_url.as_str(),
            "rediss://127.0.0.1:1",
            "valkeys://127.0.0.1:1",
            "redis://127.0.0.1:1?bogus=1",
            "memcached://x",
        ] {
            let checked = kvtier::config::KvtierConfig::build(
                None,
                &[("KVTIER_HOST_NUM_BLOCKS", "1"), ("KVTIER_REMOTE_URL", url)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                None,
            );
            let opened = open_url(url, "t");
            assert_eq!(
                checked.is_ok(),
                opened.is_ok(),
                "{url}: {checked:?} vs {:?}",
                opened.err()
            );
            if let Ok(c) = checked {
                assert!(open(c.remote.as_ref().unwrap(), "t").is_ok(), "{url}");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Regression (#13, security): a Redis password was printed by `kvtier inspect` and in
    /// errors.
    #[test]
    fn passwords_are_redacted_from_urls_and_errors() {
        assert_eq!(
            redact_url("redis://user:hunter2@h:1/0?pool=2"),
            "redis://user:***@h:1/0?pool=2"
        );
        assert_eq!(redact_url("redis://:hunter2@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url("redis://hunter2@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("dir:///a@b"), "dir:///a@b");
        for url in [
            "redis://u:hunter2@127.0.0.1:1?bogus=1",
            "redis://u:hunter2@127.0.0.1:1?pool=0",
            "redis://u:hunter2@h1:1,h2:2/3?cluster=1",
            "redis://u:hunter2@[::1:1",
            "rediss://u:hunter2@h:1",
        ] {
            let e = config_err(url);
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn redis_url_with_options_opens_lazily() {
        // Port 1 has no server; opening must still succeed (connections are lazy).
        let s = open_url(
            "redis://127.0.0.1:1/3?connect_timeout_ms=200&io_timeout_ms=300&pool=2&ttl_s=60&backoff_ms=0",
            "t",
        );
        assert!(s.is_ok());
    }
}
