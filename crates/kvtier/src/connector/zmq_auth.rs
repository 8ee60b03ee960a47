//! Authentication of the leader <-> worker channel: a per-deployment secret, and HMAC-SHA256 tags
//! on the handshake.
//!
//! Where the secret comes from, in order:
//! 1. `KVTIER_ZMQ_SECRET` (at least 16 bytes), the same in the leader's and every rank's
//!    environment: the way for ranks on other hosts;
//! 2. otherwise a key file the leader generates at bind (32 random bytes), readable only by its
//!    user: `$XDG_RUNTIME_DIR/kvtier/` or `<tmp>/kvtier-<uid>/` (or, when another user made
//!    that one first or made it public, `$HOME/.cache/kvtier-<uid>/`), named after the endpoint's port
//!    (`zmq-tcp-<port>.key`) or socket path (`zmq-ipc-<hash>.key`). Ranks on the same host, under
//!    the same user, read it. The directory must be owned by the user and mode 0700, the file
//!    0600, or it is refused.
//!
//! Protocol: a worker first asks for a challenge (`Hi`); the leader answers that peer with a fresh
//! 16-byte challenge, good for one hello. The worker's hello carries a fresh 16-byte nonce and
//! `HMAC(secret, "kvtier-zmq-hello\0" || challenge || nonce || postcard(RankLayout))`; the leader
//! refuses (and logs, rate-limited, naming the peer) a hello without a challenge it issued to that
//! peer, or whose tag does not verify, answers it with `Reject(AUTH_FAILED)`, and never counts it as
//! a rank. So a captured hello replayed to a later (restarted) leader is refused (#28): it answers
//! another challenge. The leader's welcome to each rank
//! carries `HMAC(secret, "kvtier-zmq-welcome\0" || that rank's nonce || postcard(ClusterLayout))`,
//! so a rank only accepts the layout from a leader that knows the secret. After the handshake the
//! leader only takes reports from the ranks it welcomed.
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::connector::ConnectorError;

/// The reason a leader gives a peer whose hello did not authenticate.
pub const AUTH_FAILED: &str = "authentication failed (KVTIER_ZMQ_SECRET or the leader's key file)";
/// The environment variable that holds a deployment's channel secret.
pub const SECRET_ENV: &str = "KVTIER_ZMQ_SECRET";

const HELLO_DOMAIN: &[u8] = b"kvtier-zmq-hello\0";
const WELCOME_DOMAIN: &[u8] = b"kvtier-zmq-welcome\0";

/// A deployment's channel secret. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct ChannelSecret(Vec<u8>);

impl std::fmt::Debug for ChannelSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChannelSecret(<{} bytes>)", self.0.len())
    }
}

fn auth_err(m: String) -> ConnectorError {
    ConnectorError::Handshake(m)
}

/// `n` bytes from the kernel's random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], ConnectorError> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| auth_err(format!("reading /dev/urandom: {e}")))?;
    Ok(b)
}

impl ChannelSecret {
    /// A secret of at least 16 bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, ConnectorError> {
        let b = bytes.into();
        if b.len() < 16 {
            return Err(auth_err(format!(
                "the channel secret must be at least 16 bytes, got {}",
                b.len()
            )));
        }
        Ok(ChannelSecret(b))
    }

    /// 32 fresh random bytes.
    pub fn generate() -> Result<Self, ConnectorError> {
        Ok(ChannelSecret(random_bytes::<32>()?.to_vec()))
    }

    /// `KVTIER_ZMQ_SECRET`, if set and non-empty.
    pub fn from_env() -> Option<Result<Self, ConnectorError>> {
        let v = std::env::var_os(SECRET_ENV)?;
        if v.is_empty() {
            return None;
        }
        Some(Self::new(v.into_encoded_bytes()).map_err(|e| auth_err(format!("{SECRET_ENV}: {e}"))))
    }

    fn tag(&self, domain: &[u8], nonce: &[u8], body: &[u8]) -> [u8; 32] {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut m = match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => return [0u8; 32],
        };
        m.update(domain);
        m.update(nonce);
        m.update(body);
        m.finalize().into_bytes().into()
    }

    fn verify(&self, domain: &[u8], nonce: &[u8], body: &[u8], tag: &[u8; 32]) -> bool {
        let Ok(mut m) = Hmac::<Sha256>::new_from_slice(&self.0) else {
            return false;
        };
        m.update(domain);
        m.update(nonce);
        m.update(body);
        m.verify_slice(tag).is_ok()
    }

    pub(crate) fn hello_tag(
        &self,
        challenge: &[u8; 16],
        nonce: &[u8; 16],
        layout: &[u8],
    ) -> [u8; 32] {
        self.tag(HELLO_DOMAIN, &[&challenge[..], &nonce[..]].concat(), layout)
    }
    pub(crate) fn hello_ok(
        &self,
        challenge: &[u8; 16],
        nonce: &[u8; 16],
        layout: &[u8],
        tag: &[u8; 32],
    ) -> bool {
        self.verify(
            HELLO_DOMAIN,
            &[&challenge[..], &nonce[..]].concat(),
            layout,
            tag,
        )
    }
    pub(crate) fn welcome_tag(&self, nonce: &[u8; 16], layout: &[u8]) -> [u8; 32] {
        self.tag(WELCOME_DOMAIN, nonce, layout)
    }
    pub(crate) fn welcome_ok(&self, nonce: &[u8; 16], layout: &[u8], tag: &[u8; 32]) -> bool {
        self.verify(WELCOME_DOMAIN, nonce, layout, tag)
    }

    fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_hex(s: &str) -> Option<Self> {
        let s = s.trim();
        if !s.len().is_multiple_of(2) {
            return None;
        }
        let bytes: Option<Vec<u8>> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
            .collect();
        Self::new(bytes?).ok()
    }
}

/// Creates `dir` (mode 0700) if missing and checks it is a directory owned by `uid` that no one
/// else can enter; the reason if not.
fn private_or_why(dir: &Path, uid: u32) -> Result<(), String> {
    let _ = std::fs::DirBuilder::new().mode(0o700).create(dir);
    let m = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if !m.is_dir() || m.uid() != uid || m.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "it must be a directory owned by uid {uid} with mode 0700"
        ));
    }
    Ok(())
}

/// The private directory of key files: `$XDG_RUNTIME_DIR/kvtier`, else `<tmp>/kvtier-<uid>`;
/// when another user made the latter first (or made it public), `$HOME/.cache/kvtier-<uid>`
/// instead of failing (#28: any local user could stop a leader from starting). The fallback is
/// fixed, not a fresh `mkdtemp` directory, because the ranks must find the leader's key file
/// (and the bindings' default socket) by name. Each is created 0700 and refused unless owned
/// by this user and private.
fn key_dir_in(
    uid: u32,
    xdg: Option<PathBuf>,
    tmp: PathBuf,
    home: Option<PathBuf>,
) -> Result<PathBuf, ConnectorError> {
    let refuse = |dir: &Path, why: String| {
        auth_err(format!(
            "refusing key directory {}: {why} (or set {SECRET_ENV})",
            dir.display()
        ))
    };
    if let Some(x) = xdg.filter(|x| !x.as_os_str().is_empty()) {
        let dir = x.join("kvtier");
        return private_or_why(&dir, uid)
            .map(|()| dir.clone())
            .map_err(|w| refuse(&dir, w));
    }
    let dir = tmp.join(format!("kvtier-{uid}"));
    let why = match private_or_why(&dir, uid) {
        Ok(()) => return Ok(dir),
        Err(why) => why,
    };
    let Some(home) = home.filter(|h| h.is_absolute()) else {
        return Err(refuse(&dir, why));
    };
    let cache = home.join(".cache");
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cache);
    let alt = cache.join(format!("kvtier-{uid}"));
    match private_or_why(&alt, uid) {
        Ok(()) => {
            crate::warn_limited!(
                hostile = %dir.display(),
                using = %alt.display(),
                reason = %why,
                "kvtier: the temporary key directory is not private; using the home directory"
            );
            Ok(alt)
        }
        Err(w) => Err(refuse(&dir, format!("{why}; and {}: {w}", alt.display()))),
    }
}

/// [`key_dir_in`] for this process.
fn key_dir() -> Result<PathBuf, ConnectorError> {
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| auth_err(format!("finding this process's uid: {e}")))?;
    key_dir_in(
        uid,
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
        std::env::temp_dir(),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

/// The user's private kvtier directory (`$XDG_RUNTIME_DIR/kvtier/` or `<tmp>/kvtier-<uid>/`,
/// created 0700; refused unless owned by this user and private): key files, and the Python
/// bindings' default leader socket.
pub fn private_dir() -> Result<PathBuf, ConnectorError> {
    key_dir()
}

/// The key file of `endpoint` (by TCP port or socket path).
pub fn key_file(endpoint: &str) -> Result<PathBuf, ConnectorError> {
    let name = if let Some(path) = endpoint.strip_prefix("ipc://") {
        format!(
            "zmq-ipc-{:016x}.key",
            xxhash_rust::xxh3::xxh3_64(path.as_bytes())
        )
    } else {
        let port = endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| auth_err(format!("endpoint {endpoint:?} has no port")))?;
        format!("zmq-tcp-{port}.key")
    };
    Ok(key_dir()?.join(name))
}

fn write_key_file(path: &Path, secret: &ChannelSecret) -> Result<(), ConnectorError> {
    let nonce: [u8; 8] = random_bytes()?;
    let tmp = path.with_extension(format!("tmp{}", u64::from_le_bytes(nonce)));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(secret.to_hex().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        auth_err(format!("writing key file {}: {e}", path.display()))
    })
}

/// Reads a key file; `Ok(None)` if it does not exist (yet).
fn read_key_file(path: &Path) -> Result<Option<ChannelSecret>, ConnectorError> {
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(auth_err(format!("key file {}: {e}", path.display()))),
    };
    if !m.is_file() || m.permissions().mode() & 0o077 != 0 {
        return Err(auth_err(format!(
            "refusing key file {}: it must be a regular file of mode 0600",
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| auth_err(format!("key file {}: {e}", path.display())))?;
    ChannelSecret::from_hex(&text)
        .map(Some)
        .ok_or_else(|| auth_err(format!("key file {} is malformed", path.display())))
}

/// A key file the leader wrote; removed when dropped (the leader's socket closes).
#[derive(Debug)]
pub struct KeyFileGuard(Option<PathBuf>);

impl Drop for KeyFileGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The leader's secret for the endpoint it bound: `KVTIER_ZMQ_SECRET`, else a fresh one written to
/// the endpoint's key file (removed when the guard drops).
pub fn leader_secret(bound: &str) -> Result<(ChannelSecret, KeyFileGuard), ConnectorError> {
    if let Some(s) = ChannelSecret::from_env() {
        return s.map(|s| (s, KeyFileGuard(None)));
    }
    let s = ChannelSecret::generate()?;
    let path = key_file(bound)?;
    write_key_file(&path, &s)?;
    Ok((s, KeyFileGuard(Some(path))))
}

/// A rank's secret for `endpoint`: `KVTIER_ZMQ_SECRET`, else the endpoint's key file (`None`
/// while the leader has not written it).
pub fn worker_secret(endpoint: &str) -> Result<Option<ChannelSecret>, ConnectorError> {
    if let Some(s) = ChannelSecret::from_env() {
        return s.map(Some);
    }
    read_key_file(&key_file(endpoint)?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tags_bind_secret_nonce_and_body() {
        let s = ChannelSecret::new(vec![7u8; 32]).unwrap();
        let other = ChannelSecret::new(vec![8u8; 32]).unwrap();
        let n = [1u8; 16];
        let c = [9u8; 16];
        let t = s.hello_tag(&c, &n, b"layout");
        assert!(s.hello_ok(&c, &n, b"layout", &t));
        assert!(!other.hello_ok(&c, &n, b"layout", &t));
        assert!(!s.hello_ok(&c, &[2u8; 16], b"layout", &t));
        assert!(
            !s.hello_ok(&[3u8; 16], &n, b"layout", &t),
            "another challenge"
        );
        assert!(!s.hello_ok(&c, &n, b"layoux", &t));
        assert!(!s.welcome_ok(&n, b"layout", &t), "domains are separate");
        assert!(ChannelSecret::new(vec![0u8; 15]).is_err());
        assert_eq!(format!("{s:?}"), "ChannelSecret(<32 bytes>)");
    }

    /// Regression (#28): any local user could stop another user's leader from starting by
    /// creating `<tmp>/kvtier-<uid>` first when XDG_RUNTIME_DIR is unset. A hostile directory
    /// (public, or not a directory) is passed over for `$HOME/.cache/kvtier-<uid>`, 0700.
    #[test]
    fn hostile_tmp_key_dir_falls_back_to_home() {
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        let tmp = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        let taken = tmp.path().join(format!("kvtier-{uid}"));
        std::fs::create_dir(&taken).unwrap();
        std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o777)).unwrap();
        let got = key_dir_in(uid, None, tmp.path().into(), Some(home.path().into())).unwrap();
        assert_eq!(
            got,
            home.path().join(".cache").join(format!("kvtier-{uid}"))
        );
        let m = std::fs::metadata(&got).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        // A file in its place, too; a private directory of ours is used as it is.
        std::fs::remove_dir(&taken).unwrap();
        std::fs::write(&taken, b"x").unwrap();
        assert!(key_dir_in(uid, None, tmp.path().into(), Some(home.path().into())).is_ok());
        std::fs::remove_file(&taken).unwrap();
        let ok = key_dir_in(uid, None, tmp.path().into(), Some(home.path().into())).unwrap();
        assert_eq!(ok, taken);
        // Without a home to fall back to, the error says why.
        std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = key_dir_in(uid, None, tmp.path().into(), None).unwrap_err();
        assert!(e.to_string().contains("mode 0700"), "{e}");
    }

    #[test]
    fn key_file_round_trips_and_must_be_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.key");
        assert!(read_key_file(&p).unwrap().is_none());
        let s = ChannelSecret::generate().unwrap();
        write_key_file(&p, &s).unwrap();
        assert_eq!(read_key_file(&p).unwrap(), Some(s));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_key_file(&p).is_err());
    }
}
