//! `remote.url`: the one parser of the remote tier's URL, used by the configuration check and by
//! kvtier-io when it opens the store, so the two can never disagree about what is accepted.
//!
//! Accepted (parsed with the `url` crate):
//! - `redis://[user:password@]host[:port][/db]` and `valkey://…`: one Redis-protocol server;
//! - `redis://[user:password@]h1:p1,h2:p2?cluster=1`: the seed nodes of a Redis/Valkey Cluster;
//! - `redis+unix:///path/to.sock`, `valkey+unix://…`, `unix://…`: a server on a Unix socket (the
//!   `redis` crate's own `db`, `user`, `pass` options apply);
//! - `dir:///absolute/path`: one file per block under a (shared) directory;
//! - `node:///absolute/socket`: this machine's node tier (`kvtier node`), one host cache shared
//!   by every engine process here (options `io_timeout_ms`, default 2000, `pool`, default 4,
//!   `node_uid`, a uid whose node this engine attaches to besides its own; repeatable, or
//!   comma-separated, and `verify`, a boolean, default off: check every block against a checksum
//!   of its writer's private bytes even on a node of this uid).
//!
//! kvtier's options go in the query string: `connect_timeout_ms`, `io_timeout_ms`, `pool`,
//! `ttl_s`, `backoff_ms`, `cluster` (Redis) and `fsync` (dir); the `redis` crate's `protocol` and
//! `db` pass through. An unknown option is an error (a typo must not silently drop a timeout).
//!
//! Refused: `rediss://`/`valkeys://` (TLS): kvtier is built without the `redis` crate's TLS
//! features; the message says to use a TLS tunnel (e.g. stunnel) and `redis://`.
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::value::{bool_reason, parse_bool, parse_u64};

/// Where the shared remote tier lives: a parsed `remote.url`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteTarget {
    /// The URL as given. The Redis client reads it too (it ignores kvtier's options).
    pub url: String,
    /// Which store, with kvtier's options parsed.
    pub backend: RemoteBackend,
    /// `remote.mac_key_file`: a file holding the secret that makes each value's tag a keyed MAC
    /// (Redis and directory stores). None: the tag is an unkeyed integrity check.
    #[serde(default)]
    pub mac_key_file: Option<PathBuf>,
}

/// The store behind a [`RemoteTarget`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteBackend {
    /// A Redis/Valkey server or cluster.
    Redis(RedisTarget),
    /// A shared directory; `fsync` syncs each value before publishing it.
    Dir {
        /// The (shared) directory.
        path: PathBuf,
        /// Sync each value before publishing it.
        fsync: bool,
    },
    /// The node tier at a Unix socket (`kvtier node`).
    Node {
        /// The node's Unix socket.
        socket: PathBuf,
        /// Bound on each socket read and write (default 2 s).
        io_timeout: Duration,
        /// Connections kept open to the node (default 4).
        pool: usize,
        /// Users besides the engine's own whose node it may attach to (`node_uid`; none by
        /// default: only a node of the engine's own uid).
        #[serde(default)]
        node_uids: Vec<u32>,
        /// Check every block against its writer's checksum even on a node of the engine's own
        /// uid (`verify`; a node of another uid is always checked).
        #[serde(default)]
        verify: bool,
    },
}

/// A Redis-protocol server or cluster and kvtier's client options for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedisTarget {
    /// A Unix socket instead of TCP.
    pub unix: bool,
    /// Cluster mode: the seed nodes (`redis://[userinfo@]host:port` each); empty otherwise.
    pub cluster_seeds: Vec<String>,
    /// Bound on establishing a connection. Default 1 s.
    pub connect_timeout: Duration,
    /// Bound on each socket read and write. Default 5 s.
    pub io_timeout: Duration,
    /// Connections kept open at most. Default 8.
    pub pool_size: usize,
    /// Expiry of stored values; None = the server's eviction policy.
    pub ttl: Option<Duration>,
    /// How long operations fail fast after a connection failure. Default 1 s; zero disables.
    pub backoff: Duration,
    /// Each failed probe doubles the backoff up to this. Default 30 s.
    pub max_backoff: Duration,
    /// Deadline of a lookup (`contains`, which runs on the engine's step). Default 250 ms.
    pub lookup_timeout: Duration,
    /// Consecutive missed deadlines, resets or protocol errors that mark the server down (a
    /// refused connection does at once). Default 3.
    pub trip_after: u32,
}

impl Default for RedisTarget {
    fn default() -> Self {
        RedisTarget {
            unix: false,
            cluster_seeds: Vec::new(),
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            pool_size: 8,
            ttl: None,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            lookup_timeout: Duration::from_millis(250),
            trip_after: 3,
        }
    }
}

impl RemoteTarget {
    /// A directory store at `path` with default options (no fsync).
    pub fn dir(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        RemoteTarget {
            url: format!("dir://{}", path.display()),
            backend: RemoteBackend::Dir { path, fsync: false },
            mac_key_file: None,
        }
    }

    /// Parse a remote URL; the error says what is wrong (without the setting's name) and never
    /// contains the URL's password.
    pub fn parse(url: &str) -> Result<Self, RemoteUrlError> {
        Self::parse_raw(url.trim()).map_err(|e| RemoteUrlError(redact_message(&e, url.trim())))
    }

    fn parse_raw(url: &str) -> Result<Self, String> {
        let (scheme, _) = url.split_once("://").ok_or_else(|| {
            format!("`{url}` has no scheme (redis://, valkey://, redis+unix:// or dir://)")
        })?;
        let scheme = scheme.to_ascii_lowercase();
        let backend = match scheme.as_str() {
            "dir" => parse_dir(url)?,
            "node" => parse_node(url)?,
            "redis" | "valkey" => parse_redis_tcp(url, &scheme)?,
            "redis+unix" | "valkey+unix" | "unix" => parse_redis_unix(url)?,
            "rediss" | "valkeys" => {
                return Err(format!(
                    "`{url}`: TLS ({scheme}://) is not built into kvtier; reach the server through \
                     a TLS tunnel (e.g. stunnel) and use redis://"
                ))
            }
            other => {
                return Err(format!(
                    "`{url}`: unknown remote store scheme `{other}` (expected redis://, valkey://, \
                     redis+unix://, valkey+unix://, unix://, dir:// or node://)"
                ))
            }
        };
        Ok(RemoteTarget {
            url: url.to_owned(),
            backend,
            mac_key_file: None,
        })
    }

    /// A Redis/Valkey cluster (several seed nodes).
    pub fn is_cluster(&self) -> bool {
        matches!(&self.backend, RemoteBackend::Redis(r) if !r.cluster_seeds.is_empty())
    }
}

/// Why a remote URL was refused: the reason, naming the bad part, with the URL's password
/// redacted (the text `kvtier inspect` and the configuration errors show).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RemoteUrlError(pub String);

/// Why an `http://` endpoint was refused (the URL and the reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HttpEndpointError(pub String);

/// An `http://host[:port][/base]` endpoint (the CLI's prefill server): `(authority, base
/// path)`, the authority always `host:port` (port 80 by default), the base path without a
/// trailing `/`. Parsed with the same `url` crate as the remote URL; anything but plain `http://`
/// with a host is refused.
pub fn parse_http_endpoint(url: &str) -> Result<(String, String), HttpEndpointError> {
    let u = url::Url::parse(url).map_err(|e| HttpEndpointError(format!("`{url}`: {e}")))?;
    if u.scheme() != "http" {
        return Err(HttpEndpointError(format!(
            "`{url}`: only http:// is supported"
        )));
    }
    let host = match u.host() {
        Some(url::Host::Ipv6(a)) => format!("[{a}]"),
        Some(h) => h.to_string(),
        None => return Err(HttpEndpointError(format!("`{url}`: no host"))),
    };
    let port = u.port_or_known_default().unwrap_or(80);
    Ok((
        format!("{host}:{port}"),
        u.path().trim_end_matches('/').to_string(),
    ))
}

/// `url` with the password of its userinfo replaced by `***` (`redis://user:***@host`,
/// `redis://:***@host`, and `redis://***@host` where a lone userinfo is the password), for logs,
/// errors and `kvtier inspect`. Everything else is unchanged.
pub fn redact_url(url: &str) -> String {
    match secret(url) {
        Some(s) if !s.is_empty() => url.replacen(s, "***", 1),
        _ => url.to_owned(),
    }
}

/// The password part of `url`'s userinfo, if any.
fn secret(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let (userinfo, _) = authority.rsplit_once('@')?;
    Some(match userinfo.split_once(':') {
        Some((_, pass)) => pass,
        None => userinfo,
    })
}

/// `msg` with every occurrence of `url`'s password replaced by `***`.
fn redact_message(msg: &str, url: &str) -> String {
    match secret(url) {
        Some(s) if !s.is_empty() => msg.replace(s, "***"),
        _ => msg.to_owned(),
    }
}

fn query_pairs(query: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for part in query.split('&').filter(|p| !p.is_empty()) {
        if !part.contains('=') {
            return Err(format!("option `{part}` has no value"));
        }
        out.extend(
            url::form_urlencoded::parse(part.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned())),
        );
    }
    Ok(out)
}

fn opt_bool(k: &str, v: &str) -> Result<bool, String> {
    parse_bool(v).ok_or_else(|| format!("option {k}: {}", bool_reason(v)))
}

fn opt_num(k: &str, v: &str) -> Result<u64, String> {
    parse_u64(v).ok_or_else(|| format!("option {k}={v:?} is not a whole number >= 0"))
}

fn parse_dir(url: &str) -> Result<RemoteBackend, String> {
    let rest = &url["dir://".len()..];
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() {
        return Err("dir:// needs a path, e.g. dir:///mnt/kv".into());
    }
    if !path.starts_with('/') {
        return Err(format!(
            "`{url}`: the directory must be an absolute path (dir:///abs/path)"
        ));
    }
    let mut fsync = false;
    for (k, v) in query_pairs(query)? {
        match k.as_str() {
            "fsync" => fsync = opt_bool(&k, &v)?,
            _ => {
                return Err(format!(
                    "unknown option `{k}` in `{url}` (dir:// takes fsync)"
                ))
            }
        }
    }
    Ok(RemoteBackend::Dir {
        path: PathBuf::from(path),
        fsync,
    })
}

fn parse_node(url: &str) -> Result<RemoteBackend, String> {
    let rest = &url["node://".len()..];
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if !path.starts_with('/') {
        return Err(format!(
            "`{url}`: the node's socket must be an absolute path (node:///run/kvtier/node.sock)"
        ));
    }
    let mut io_timeout = Duration::from_secs(2);
    let mut pool = 4usize;
    let mut node_uids = Vec::new();
    let mut verify = false;
    for (k, v) in query_pairs(query)? {
        match k.as_str() {
            "io_timeout_ms" => io_timeout = Duration::from_millis(opt_num(&k, &v)?),
            "verify" => {
                verify =
                    parse_bool(&v).ok_or_else(|| format!("option verify={v}: {}", bool_reason(&v)))?
            }
            "node_uid" => {
                for u in v.split(',') {
                    node_uids.push(
                        u.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("option node_uid={v}: `{u}` is not a uid"))?,
                    );
                }
            }
            "pool" => {
                pool = usize::try_from(opt_num(&k, &v)?)
                    .map_err(|_| format!("option pool={v} is too large"))?
            }
            _ => {
                return Err(format!(
                    "unknown option `{k}` in `{url}` (node:// takes io_timeout_ms, pool, node_uid, verify)"
                ))
            }
        }
    }
    if io_timeout.is_zero() || pool == 0 {
        return Err(format!("`{url}`: io_timeout_ms and pool must be positive"));
    }
    Ok(RemoteBackend::Node {
        socket: PathBuf::from(path),
        io_timeout,
        pool,
        node_uids,
        verify,
    })
}

/// kvtier's Redis options and the crate's pass-through ones; `unix_extra` adds the crate's
/// Unix-socket options.
fn redis_options(url: &str, query: &str, unix_extra: bool) -> Result<(RedisTarget, bool), String> {
    let mut t = RedisTarget::default();
    let mut cluster = false;
    for (k, v) in query_pairs(query)? {
        match k.as_str() {
            "connect_timeout_ms" => t.connect_timeout = Duration::from_millis(opt_num(&k, &v)?),
            "io_timeout_ms" => t.io_timeout = Duration::from_millis(opt_num(&k, &v)?),
            "pool" => {
                t.pool_size = usize::try_from(opt_num(&k, &v)?)
                    .map_err(|_| format!("option pool={v} is too large"))?
            }
            "ttl_s" => t.ttl = Some(Duration::from_secs(opt_num(&k, &v)?)),
            "backoff_ms" => t.backoff = Duration::from_millis(opt_num(&k, &v)?),
            "max_backoff_ms" => t.max_backoff = Duration::from_millis(opt_num(&k, &v)?),
            "lookup_timeout_ms" => t.lookup_timeout = Duration::from_millis(opt_num(&k, &v)?),
            "trip_after" => {
                t.trip_after = u32::try_from(opt_num(&k, &v)?)
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("option trip_after={v} must be 1..=4294967295"))?
            }
            "cluster" => cluster = opt_bool(&k, &v)?,
            "protocol" => {
                if !matches!(v.as_str(), "2" | "3" | "resp2" | "resp3") {
                    return Err(format!("option protocol={v:?} is not resp2 or resp3"));
                }
            }
            "db" | "user" | "pass" if unix_extra => {}
            _ => {
                return Err(format!(
                    "unknown option `{k}` in `{url}` (connect_timeout_ms, io_timeout_ms, pool, \
                     ttl_s, backoff_ms, max_backoff_ms, lookup_timeout_ms, trip_after, cluster, \
                     protocol)"
                ))
            }
        }
    }
    if t.pool_size == 0 {
        return Err("option pool: the pool_size must be at least 1".into());
    }
    if t.connect_timeout.is_zero() || t.io_timeout.is_zero() {
        return Err("option connect_timeout_ms/io_timeout_ms: timeouts must be positive".into());
    }
    if t.ttl.is_some_and(|d| d.is_zero()) {
        return Err("option ttl_s: must be at least 1".into());
    }
    Ok((t, cluster))
}

fn check_server(u: &url::Url, whole: &str) -> Result<(), String> {
    match u.host_str() {
        None | Some("") => Err(format!("`{whole}` has no host")),
        Some("0.0.0.0") | Some("[::]") => {
            Err(format!("`{whole}`: cannot connect to a wildcard address"))
        }
        Some(_) => Ok(()),
    }
}

fn parse_redis_tcp(url: &str, scheme: &str) -> Result<RemoteBackend, String> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut t, cluster) = redis_options(url, query, false)?;
    let rest = &base[scheme.len() + "://".len()..];
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let db_ok = |p: &str| p.is_empty() || p.parse::<u32>().is_ok();
    if !db_ok(path) {
        return Err(format!("`{url}`: the path must be a database number"));
    }
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let hosts: Vec<&str> = hosts.split(',').collect();
    if hosts.len() > 1 && !cluster {
        return Err(format!(
            "`{url}` names several hosts: add ?cluster=1 for a Redis/Valkey Cluster"
        ));
    }
    for h in &hosts {
        let seed = format!("{scheme}://{userinfo}{h}");
        let u = url::Url::parse(&seed).map_err(|e| format!("`{url}`: {e}"))?;
        check_server(&u, url)?;
        if cluster {
            t.cluster_seeds.push(seed);
        }
    }
    if cluster && !(path.is_empty() || path == "0") {
        return Err(format!("`{url}`: a cluster has only database 0"));
    }
    Ok(RemoteBackend::Redis(t))
}

fn parse_redis_unix(url: &str) -> Result<RemoteBackend, String> {
    let u = url::Url::parse(url).map_err(|e| format!("`{url}`: {e}"))?;
    if u.to_file_path().is_err() || u.path().len() <= 1 {
        return Err(format!(
            "`{url}` needs an absolute socket path, e.g. redis+unix:///run/redis.sock"
        ));
    }
    let query = u.query().unwrap_or("");
    let (mut t, cluster) = redis_options(url, query, true)?;
    if cluster {
        return Err(format!(
            "`{url}`: cluster mode needs redis:// or valkey:// seeds"
        ));
    }
    t.unix = true;
    Ok(RemoteBackend::Redis(t))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn err(url: &str) -> String {
        RemoteTarget::parse(url).unwrap_err().to_string()
    }

    #[test]
    fn accepted_forms() {
        let r = RemoteTarget::parse("redis://10.0.0.5:6379/2?pool=2&ttl_s=60").unwrap();
        let RemoteBackend::Redis(t) = &r.backend else {
            panic!("{r:?}")
        };
        assert_eq!(
            (t.pool_size, t.ttl, t.unix),
            (2, Some(Duration::from_secs(60)), false)
        );
        assert!(!r.is_cluster());
        let c = RemoteTarget::parse("valkey://u:p@h1:1,h2:2?cluster=1").unwrap();
        assert!(c.is_cluster());
        let RemoteBackend::Redis(t) = &c.backend else {
            panic!()
        };
        assert_eq!(
            t.cluster_seeds,
            vec!["valkey://u:p@h1:1", "valkey://u:p@h2:2"]
        );
        let u = RemoteTarget::parse("redis+unix:///run/redis.sock?db=3").unwrap();
        assert!(matches!(&u.backend, RemoteBackend::Redis(t) if t.unix));
        let d = RemoteTarget::parse("dir:///mnt/kv?fsync=yes").unwrap();
        assert_eq!(
            d.backend,
            RemoteBackend::Dir {
                path: "/mnt/kv".into(),
                fsync: true
            }
        );
        assert_eq!(RemoteTarget::dir("/x").url, "dir:///x");
    }

    #[test]
    fn refused_forms_say_why() {
        assert!(err("localhost:6379").contains("no scheme"));
        assert!(err("http://x").contains("unknown remote store scheme"));
        assert!(err("rediss://x:1").contains("TLS"));
        assert!(err("valkeys://x:1").contains("TLS"));
        assert!(err("redis://h:1?io_timeout=5").contains("unknown option"));
        assert!(err("redis://h:1?pool=0").contains("pool_size"));
        assert!(err("redis://h:1?pool=x").contains("whole number"));
        assert!(err("redis://h:1?io_timeout_ms=0").contains("timeouts"));
        assert!(err("redis://h:1?cluster=maybe").contains("boolean"));
        assert!(err("redis://h:notaport").contains("invalid port"));
        assert!(err("redis://h1:1,h2:2").contains("cluster=1"));
        assert!(err("redis://h1:1,h2:2/3?cluster=1").contains("database 0"));
        assert!(err("redis://h:1/x").contains("database number"));
        assert!(err("redis://:1").contains("host"));
        assert!(err("redis://0.0.0.0:1").contains("wildcard"));
        assert!(err("redis+unix://").contains("socket path"));
        assert!(err("redis+unix:///s?cluster=1").contains("cluster"));
        assert!(err("dir://relative/path").contains("absolute"));
        assert!(err("dir://").contains("needs a path"));
        assert!(err("dir:///tmp/x?fsync=maybe").contains("fsync"));
        assert!(err("dir:///tmp/x?pool=1").contains("unknown option"));
    }

    #[test]
    fn node_uids_are_parsed_and_checked() {
        let t = RemoteTarget::parse("node:///run/k/node.sock?node_uid=0,1000&node_uid=7").unwrap();
        let RemoteBackend::Node { node_uids, .. } = t.backend else {
            panic!("not a node: {t:?}");
        };
        assert_eq!(node_uids, vec![0, 1000, 7]);
        let t = RemoteTarget::parse("node:///run/k/node.sock").unwrap();
        assert!(matches!(t.backend, RemoteBackend::Node { node_uids, .. } if node_uids.is_empty()));
        assert!(err("node:///s?node_uid=root").contains("not a uid"));
    }

    #[test]
    fn node_verify_is_a_boolean_off_by_default() {
        let verify = |url: &str| match RemoteTarget::parse(url).unwrap().backend {
            RemoteBackend::Node { verify, .. } => verify,
            other => panic!("not a node: {other:?}"),
        };
        assert!(!verify("node:///run/k/node.sock"));
        assert!(verify("node:///run/k/node.sock?verify=1"));
        assert!(!verify("node:///run/k/node.sock?verify=false"));
        assert!(err("node:///s?verify=maybe").contains("verify"));
    }
}
