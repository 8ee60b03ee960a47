//! [`DirStore`]: the remote store on a shared directory (NFS, a shared volume, or local disk for
//! processes of one machine). One file per key:
//! `<root>/kvtier-v<scheme>/<ns>/<first 2 hex digits>/<32 hex digits>`, holding `frame` bytes.
//!
//! Invariants:
//! - a value file is only ever created by renaming a fully written temporary file (`.<hex>.<pid>.<n>.tmp`
//!   in the same directory) over its final name, so readers see the old value, the new value, or
//!   none, never a mixture; concurrent writers of one key each rename a complete file;
//! - files are created mode 0600 and directories mode 0700 (the store's own subtree);
//! - `get` reads the payload straight into the caller's buffer and accepts it only after the
//!   header and checksum match (a truncated or damaged file is an error, never wrong bytes).
//!
//! Temporary files of a writer that died mid-put are left behind; they never shadow a value.
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier::hash::SequenceHash;
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};

use super::frame::{self, HEADER_LEN};
use super::key::{hex, Namespace};

/// Tunables of a [`DirStore`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirOptions {
    /// `fdatasync` each value before publishing it (durability across a machine crash; without
    /// it a crash can leave a damaged file, which `get` then rejects). Default off.
    pub fsync: bool,
}

/// A content-addressed block store on a (shared) directory. See the module docs.
#[derive(Debug)]
pub struct DirStore {
    root: PathBuf,
    ns: Namespace,
    seal: frame::FrameSeal,
    opts: DirOptions,
    tmp_seq: AtomicU64,
}

fn unavailable(op: &'static str, path: &Path, e: &io::Error) -> RemoteError {
    RemoteError::Unavailable {
        op,
        reason: format!("{}: {e}", path.display()),
    }
}

fn private_dir() -> DirBuilder {
    let mut b = DirBuilder::new();
    b.recursive(true).mode(0o700);
    b
}

/// Reads until `buf` is full or end of file; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl DirStore {
    /// A store under `base` (created mode 0700 if absent) for `namespace`.
    pub fn open(base: &Path, namespace: &str, opts: DirOptions) -> Result<Self, RemoteError> {
        let ns = Namespace::new(namespace)?;
        if !base.is_absolute() {
            return Err(RemoteError::Config(format!(
                "dir store path {} must be absolute",
                base.display()
            )));
        }
        let root = base.join(ns.dir_component());
        private_dir()
            .create(&root)
            .map_err(|e| unavailable("open", &root, &e))?;
        Ok(DirStore {
            root,
            seal: frame::FrameSeal::for_namespace(ns.as_str()),
            ns,
            opts,
            tmp_seq: AtomicU64::new(0),
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

    /// The file that holds `key`'s value (whether or not it exists).
    pub fn path_of(&self, key: u128) -> PathBuf {
        let h = hex(key);
        self.root.join(&h[..2]).join(&h)
    }

    fn put_inner(&self, key: u128, data: &[u8]) -> Result<(), RemoteError> {
        let path = self.path_of(key);
        let dir = path.parent().unwrap_or(&self.root);
        private_dir()
            .create(dir)
            .map_err(|e| unavailable("put", dir, &e))?;
        let tmp = dir.join(format!(
            ".{}.{}.{}.tmp",
            hex(key),
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&frame::encode_header(&self.seal, key, data))?;
            f.write_all(data)?;
            if self.opts.fsync {
                f.sync_data()?;
            }
            drop(f);
            fs::rename(&tmp, &path)
        })();
        written.map_err(|e| {
            // Best effort: the temporary name is unique to this call and never read.
            let _ = fs::remove_file(&tmp);
            unavailable("put", &path, &e)
        })
    }

    fn get_inner(&self, key: u128, out: &mut [u8]) -> Result<(), RemoteError> {
        let path = self.path_of(key);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(RemoteError::Missing {
                    key: SequenceHash(key),
                })
            }
            Err(e) => return Err(unavailable("get", &path, &e)),
        };
        let io_err = |e: io::Error| unavailable("get", &path, &e);
        let expected = HEADER_LEN + out.len();
        let mut head = [0u8; HEADER_LEN];
        let got = read_full(&mut f, &mut head).map_err(io_err)?;
        if got < HEADER_LEN {
            return Err(RemoteError::Short {
                key: SequenceHash(key),
                expected,
                got,
            });
        }
        let header = frame::check_header(&self.seal, key, &head, out.len())?;
        let got = read_full(&mut f, out).map_err(io_err)?;
        if got < out.len() {
            return Err(RemoteError::Short {
                key: SequenceHash(key),
                expected,
                got: HEADER_LEN + got,
            });
        }
        let mut extra = [0u8; 1];
        if read_full(&mut f, &mut extra).map_err(io_err)? != 0 {
            return Err(RemoteError::Corrupt {
                key: SequenceHash(key),
                reason: "trailing bytes after the payload".into(),
            });
        }
        frame::verify_payload(&self.seal, key, header, out)
    }

    fn contains_inner(&self, keys: &[u128]) -> Result<Vec<bool>, RemoteError> {
        keys.iter()
            .map(|&k| {
                let path = self.path_of(k);
                match fs::symlink_metadata(&path) {
                    Ok(m) => Ok(m.is_file()),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                    Err(e) => Err(unavailable("contains", &path, &e)),
                }
            })
            .collect()
    }
}

impl RemoteStore for DirStore {
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
}
