//! Where the node listens: the socket's directory, the reclaim of a dead node's socket and
//! arenas, and the default socket path.
//!
//! Invariants:
//! - the node binds only in a directory that is a real directory (not a symlink) owned by the
//!   node's uid and writable by nobody else, so no other user can move the socket away or
//!   plant one first; a missing directory is created mode 0700 (0711 with `--allow-uid`, so the
//!   allowed users can reach the socket and nothing else);
//! - the stale-socket reclaim removes only a socket (`is_socket()`) that nobody listens on; a
//!   live socket is `AddrInUse`, anything else at the path (a regular file, a directory, a
//!   link) is refused and never deleted;
//! - the default socket is per user and private: `$XDG_RUNTIME_DIR/kvtier-node/node.sock`, else
//!   `/tmp/kvtier-node-<uid>/node.sock` (the directory check above applies to it like any other).
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::sys::{shm, sock};

/// The default socket of this user's node (see the module docs).
pub fn default_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(d) if d.is_absolute() => d.join("kvtier-node").join("node.sock"),
        _ => PathBuf::from(format!("/tmp/kvtier-node-{}", sock::current_uid())).join("node.sock"),
    }
}

fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why)
}

/// Create (if missing) and check the socket's directory `dir` (see the module docs);
/// `shared`: other uids are allowed to attach (the directory is made searchable, 0711).
pub(super) fn prepare_dir(dir: &Path, shared: bool) -> io::Result<()> {
    let mode = if shared { 0o711 } else { 0o700 };
    if let Err(e) = std::fs::symlink_metadata(dir) {
        if e.kind() != io::ErrorKind::NotFound {
            return Err(e);
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir)?;
    }
    // Checked after creating: someone may have created it first.
    let m = std::fs::symlink_metadata(dir)?;
    let me = sock::current_uid();
    if !m.file_type().is_dir() {
        return Err(refused(format!(
            "the socket directory {} is not a directory (symlinks are refused)",
            dir.display()
        )));
    }
    if m.uid() != me {
        return Err(refused(format!(
            "the socket directory {} belongs to uid {}, not this node's uid {me}",
            dir.display(),
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(refused(format!(
            "the socket directory {} is writable by group or others (mode {:o}); use a private one",
            dir.display(),
            m.mode() & 0o7777
        )));
    }
    if shared && m.mode() & 0o011 != 0o011 {
        let p = std::fs::Permissions::from_mode((m.mode() & 0o7777) | 0o011);
        std::fs::set_permissions(dir, p)?;
    }
    Ok(())
}

/// Remove the socket of a node that is gone; refuse a live one or anything not a socket.
pub(super) fn reclaim_stale_socket(socket: &Path) -> io::Result<()> {
    let m = match std::fs::symlink_metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !m.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket: refusing to replace it",
                socket.display()
            ),
        ));
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("a kvtier node already serves {}", socket.display()),
        ));
    }
    tracing::info!(socket = %socket.display(), "removing the socket of a node that is gone");
    std::fs::remove_file(socket)
}

/// Remove arenas of nodes that died (their flock is free) from `dir`.
pub(super) fn reclaim_stale_arenas(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("kvtier-node-") && name.ends_with(".arena")) {
            continue;
        }
        // Only our own regular files (never follow a link someone planted).
        let ours = std::fs::symlink_metadata(e.path())
            .is_ok_and(|m| m.file_type().is_file() && m.uid() == sock::current_uid());
        if !ours {
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
