//! [`from_url`]: picks and configures a remote-store backend from one URL string (the form used in
//! kvtier's configuration).
//!
//! Invariant: a URL either yields a fully configured store or a `RemoteError::Config` naming what
//! was wrong; unknown kvtier options are rejected rather than ignored (a typo must not silently
//! disable a timeout).
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvtier::transfer::{RemoteError, RemoteStore, TransferError};

use super::dir_store::{DirOptions, DirStore};
use super::redis_store::{RedisOptions, RedisStore};

/// Opens the remote store named by `url`, with its keys in `namespace`.
///
/// Backends:
/// - `redis://[user:password@]host:port[/db]`, `valkey://…`, `redis+unix:///socket` — a Redis or
///   Valkey server. Options (query string): `connect_timeout_ms` (default 1000), `io_timeout_ms`
///   (default 5000), `pool` (connections, default 8), `ttl_s` (expiry of values, default none),
///   `lookup_timeout_ms` (deadline of `contains`, the lookup on the engine's step, default 250),
///   `backoff_ms` (how long operations fail fast after a connection failure, default 1000, 0 = off;
///   each failed probe doubles it up to `max_backoff_ms`, default 30000),
///   `cluster=1` (Redis/Valkey Cluster: the hosts, comma-separated, are seed nodes:
///   `redis://h1:p1,h2:p2?cluster=1`);
///   the `redis` crate's own options (`protocol`, `db`) pass through.
/// - `dir:///absolute/path` — one file per key under the directory (shared storage). Option
///   `fsync=1` syncs each value before publishing it.
///
/// Keys are `kvtier:v<hash scheme>:<namespace>:<32 hex>` (Redis) or
/// `kvtier-v<hash scheme>/<namespace>/<2 hex>/<32 hex>` (directory). `namespace` must be 1..=64
/// characters of `[A-Za-z0-9_.-]`. Connections are made lazily: a server that is down makes
/// operations fail with `RemoteError::Unavailable`, not `from_url`.
///
/// ```
/// # fn main() -> Result<(), kvtier::transfer::TransferError> {
/// let dir = std::env::temp_dir().join(format!("kvtier-doctest-{}", std::process::id()));
/// let store = kvtier_io::remote::from_url(&format!("dir://{}", dir.display()), "docs")?;
/// store.put(7, b"block bytes")?;
/// let mut out = [0u8; 11];
/// store.get(7, &mut out)?;
/// assert_eq!(&out, b"block bytes");
/// assert_eq!(store.contains(&[7, 8])?, vec![true, false]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(()) }
/// ```
pub fn from_url(url: &str, namespace: &str) -> Result<Arc<dyn RemoteStore>, TransferError> {
    Ok(open_url(url, namespace)?)
}

fn open_url(url: &str, namespace: &str) -> Result<Arc<dyn RemoteStore>, RemoteError> {
    let (scheme, _) = url.split_once("://").ok_or_else(|| {
        RemoteError::Config(format!("remote url {:?} has no scheme", redact_url(url)))
    })?;
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let params = parse_query(query)?;
    match scheme {
        "dir" => {
            let path = &base["dir://".len()..];
            let mut opts = DirOptions::default();
            for (k, v) in &params {
                match *k {
                    "fsync" => opts.fsync = parse_bool(k, v)?,
                    _ => return Err(unknown_option(k, url)),
                }
            }
            Ok(Arc::new(DirStore::open(Path::new(path), namespace, opts)?))
        }
        "redis" | "valkey" | "redis+unix" | "valkey+unix" | "unix" => {
            let mut opts = RedisOptions::default();
            for (k, v) in &params {
                match *k {
                    "connect_timeout_ms" => opts.connect_timeout = parse_ms(k, v)?,
                    "io_timeout_ms" => opts.io_timeout = parse_ms(k, v)?,
                    "pool" => opts.pool_size = parse_num(k, v)?,
                    "ttl_s" => opts.ttl = Some(Duration::from_secs(parse_num(k, v)?)),
                    "backoff_ms" => opts.backoff = parse_ms(k, v)?,
                    "max_backoff_ms" => opts.max_backoff = parse_ms(k, v)?,
                    "lookup_timeout_ms" => opts.lookup_timeout = parse_ms(k, v)?,
                    "cluster" => opts.cluster = parse_bool(k, v)?,
                    // Understood by the redis crate itself.
                    "protocol" | "db" => {}
                    _ => return Err(unknown_option(k, url)),
                }
            }
            Ok(Arc::new(RedisStore::open(url, namespace, opts)?))
        }
        "rediss" | "valkeys" => Err(RemoteError::Config(
            "TLS (rediss://) is not built into kvtier; use a TLS tunnel or redis://".into(),
        )),
        other => Err(RemoteError::Config(format!(
            "unknown remote store scheme {other:?} (expected redis://, valkey://, redis+unix:// or dir://)"
        ))),
    }
}

/// `url` with the password of its userinfo replaced by `***` (`redis://user:***@host`,
/// `redis://:***@host`), for logs, errors and `kvtier inspect`. Everything else is unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, hosts)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    let user = match userinfo.split_once(':') {
        Some((u, _)) => format!("{u}:***"),
        // `redis://secret@host`: the redis crate reads a lone userinfo as the password.
        None => "***".to_owned(),
    };
    format!("{scheme}://{user}@{hosts}{tail}")
}

fn parse_query(q: &str) -> Result<Vec<(&str, &str)>, RemoteError> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split_once('=')
                .ok_or_else(|| RemoteError::Config(format!("option {p:?} has no value")))
        })
        .collect()
}

fn unknown_option(k: &str, url: &str) -> RemoteError {
    RemoteError::Config(format!(
        "unknown option {k:?} in remote url {:?}",
        redact_url(url)
    ))
}

fn parse_num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, RemoteError> {
    v.parse()
        .map_err(|_| RemoteError::Config(format!("option {k}={v:?} is not a valid number")))
}

fn parse_ms(k: &str, v: &str) -> Result<Duration, RemoteError> {
    Ok(Duration::from_millis(parse_num(k, v)?))
}

fn parse_bool(k: &str, v: &str) -> Result<bool, RemoteError> {
    match v {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(RemoteError::Config(format!(
            "option {k}={v:?} must be 0/1/true/false"
        ))),
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
        assert!(config_err("redis://127.0.0.1:1?pool=x").contains("not a valid number"));
        assert!(config_err("redis://127.0.0.1:1?io_timeout_ms=0").contains("timeouts"));
        assert!(config_err("dir://relative/path").contains("absolute"));
        assert!(config_err("dir:///tmp/x?fsync=maybe").contains("fsync"));
        assert!(matches!(
            open_url("redis://127.0.0.1:1", "bad/ns"),
            Err(RemoteError::Config(_))
        ));
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
