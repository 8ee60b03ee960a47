//! Opening, preallocating and probing the disk tier's data files.
//!
//! Invariant: a file opened warm (`truncate == false`) keeps its bytes: preallocation only
//! extends it and the O_DIRECT probe writes back the very page it read.
use std::fs::File;
use std::path::Path;

use super::store::DirectMode;
use crate::error::IoError;
use crate::sys::file;

/// One open data file.
#[derive(Debug)]
pub(crate) struct Opened {
    pub file: File,
    pub direct: bool,
    /// Length before this open extended it (0 for a new or truncated file).
    pub old_len: u64,
}

/// Open (or create) one data file of `len` bytes, preallocate it and probe O_DIRECT.
pub(crate) fn open_data_file(
    path: &Path,
    len: u64,
    want_direct: bool,
    mode: DirectMode,
    truncate: bool,
) -> Result<Opened, IoError> {
    if want_direct {
        match file::open_cache_file(path, true, truncate) {
            Ok(f) => {
                let old_len = current_len(&f, path)?;
                preallocate(&f, path, len)?;
                match file::probe_direct(&f) {
                    Ok(()) => {
                        return Ok(Opened {
                            file: f,
                            direct: true,
                            old_len,
                        })
                    }
                    Err(e) if mode == DirectMode::Require => {
                        return Err(IoError::Disk { path: path.to_owned(), what: "O_DIRECT I/O", source: e })
                    }
                    Err(e) => tracing::warn!(
                        "O_DIRECT I/O fails on {} ({e}); the disk tier uses buffered I/O",
                        path.display()
                    ),
                }
                let f = file::open_cache_file(path, false, false)
                    .map_err(disk_err(path, "opening a cache file"))?;
                return Ok(Opened {
                    file: f,
                    direct: false,
                    old_len,
                });
            }
            Err(e) if mode == DirectMode::Require => {
                return Err(IoError::Disk { path: path.to_owned(), what: "opening with O_DIRECT", source: e })
            }
            Err(e) => tracing::warn!(
                "O_DIRECT is not supported for {} ({e}, e.g. tmpfs); the disk tier uses buffered I/O",
                path.display()
            ),
        }
    }
    let f = file::open_cache_file(path, false, truncate)
        .map_err(disk_err(path, "creating a cache file"))?;
    let old_len = current_len(&f, path)?;
    preallocate(&f, path, len)?;
    Ok(Opened {
        file: f,
        direct: false,
        old_len,
    })
}

fn disk_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> IoError + 'a {
    move |source| IoError::Disk {
        path: path.to_owned(),
        what,
        source,
    }
}

fn current_len(f: &File, path: &Path) -> Result<u64, IoError> {
    f.metadata()
        .map(|m| m.len())
        .map_err(disk_err(path, "reading a cache file's size"))
}

fn preallocate(f: &File, path: &Path, len: u64) -> Result<(), IoError> {
    // A longer file (tampered with) is cut back to the geometry first.
    if current_len(f, path)? > len {
        f.set_len(len)
            .map_err(disk_err(path, "resizing a cache file"))?;
    }
    match file::preallocate(f, len) {
        Ok(true) => Ok(()),
        Ok(false) => {
            tracing::warn!(
                "{}: file system cannot preallocate; the file is sparse",
                path.display()
            );
            Ok(())
        }
        Err(source) => Err(IoError::Disk {
            path: path.to_owned(),
            what: "preallocating (is the disk full? lower disk_bytes or free space)",
            source,
        }),
    }
}
