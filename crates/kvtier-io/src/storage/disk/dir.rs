//! Where the disk tier's files live, and who owns them.
//!
//! Invariants:
//! - kvtier never changes the mode of a directory it did not create: the configured `disk.dir`
//!   may be shared (e.g. `/tmp`, sticky and world-writable); kvtier creates its own subdirectory
//!   [`SUBDIR`] in it with mode 0700 (and `disk.dir` itself, 0700, only if it did not exist), and
//!   refuses a subdirectory that is a symlink, owned by another user, or group/world-writable;
//! - a file set `<set>` (`<set>.lock`, `<set>.index`, `<set>-NNNNN.kvblk`) belongs to whichever
//!   store holds the exclusive `flock` on `<set>.lock`; the kernel drops the lock when its holder
//!   dies (SIGKILL included), so the next store to take it reclaims the files;
//! - lock files are never removed (removing one would let two stores lock different inodes of
//!   the same name); they are empty.
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::IoError;
use crate::sys::file;

/// kvtier's own subdirectory of `disk.dir`.
pub const SUBDIR: &str = "kvtier-g3";
/// How many sets of one name may be open at once in one directory (`name`, `name.1`, ...).
pub(crate) const MAX_SETS: u32 = 64;

fn disk_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> IoError + 'a {
    move |source| IoError::Disk {
        path: path.to_owned(),
        what,
        source,
    }
}

/// Create (if needed) and check kvtier's subdirectory of `base`; returns its path.
pub(crate) fn own_dir(base: &Path) -> Result<PathBuf, IoError> {
    if std::fs::symlink_metadata(base).is_err() {
        // Only what kvtier creates gets kvtier's mode; an existing `base` is left as it is.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(base)
            .map_err(disk_err(base, "creating the cache directory"))?;
    }
    let sub = base.join(SUBDIR);
    match std::fs::DirBuilder::new().mode(0o700).create(&sub) {
        Ok(()) => return Ok(sub),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(disk_err(&sub, "creating kvtier's cache subdirectory")(e)),
    }
    let m = std::fs::symlink_metadata(&sub)
        .map_err(disk_err(&sub, "reading kvtier's cache subdirectory"))?;
    let me = crate::sys::sock::current_uid();
    let refuse = |why: String| IoError::Disk {
        path: sub.clone(),
        what: "refusing kvtier's cache subdirectory",
        source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, why),
    };
    if !m.file_type().is_dir() {
        return Err(refuse("it is not a directory (a symlink?)".into()));
    }
    if m.uid() != me {
        return Err(refuse(format!(
            "it is owned by uid {}, not by this process (uid {me})",
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "its mode {:o} lets others write into it (kvtier creates it 0700; fix or remove it)",
            m.mode() & 0o7777
        )));
    }
    Ok(sub)
}

/// Reject names that could leave the subdirectory or hide files.
pub(crate) fn check_name(name: &str) -> Result<(), IoError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(IoError::Config(format!(
            "disk tier file name {name:?}: use 1-100 of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

/// The held lock of one file set.
#[derive(Debug)]
pub(crate) struct SetLock {
    /// Held open for the store's lifetime: closing it releases the lock.
    _file: File,
    pub set: String,
}

/// Lock the first free set of `name` in `sub`: `name` itself (the one a restart re-opens),
/// else `name.1`, `name.2`, ... (a second live store gets its own files).
pub(crate) fn lock_set(sub: &Path, name: &str) -> Result<SetLock, IoError> {
    for i in 0..MAX_SETS {
        let set = if i == 0 {
            name.to_string()
        } else {
            format!("{name}.{i}")
        };
        let path = sub.join(format!("{set}.lock"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(disk_err(&path, "opening a lock file"))?;
        if file::try_lock_exclusive(&f).map_err(disk_err(&path, "locking a file set"))? {
            return Ok(SetLock { _file: f, set });
        }
    }
    Err(IoError::Disk {
        path: sub.to_owned(),
        what: "locking a file set",
        source: std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!("all {MAX_SETS} file sets named {name:?} are in use by live stores"),
        ),
    })
}

/// Path of data file `f` of `set`.
pub(crate) fn data_path(sub: &Path, set: &str, f: u32) -> PathBuf {
    sub.join(format!("{set}-{f:05}.kvblk"))
}

/// Path of the index (journal) of `set`.
pub(crate) fn index_path(sub: &Path, set: &str) -> PathBuf {
    sub.join(format!("{set}.index"))
}

/// Remove data files `from..` of `set` (left by an earlier, larger configuration, or all of
/// them with `from == 0`).
pub(crate) fn remove_data_files_from(sub: &Path, set: &str, from: u32) {
    let Ok(rd) = std::fs::read_dir(sub) else {
        return;
    };
    let prefix = format!("{set}-");
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(num) = name
            .strip_prefix(&prefix)
            .and_then(|r| r.strip_suffix(".kvblk"))
        else {
            continue;
        };
        if num.len() != 5 || !num.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if num.parse::<u32>().is_ok_and(|n| n >= from) {
            if let Err(err) = std::fs::remove_file(e.path()) {
                tracing::warn!("removing {}: {err}", e.path().display());
            }
        }
    }
}
