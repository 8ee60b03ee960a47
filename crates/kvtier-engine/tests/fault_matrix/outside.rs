//! "Nothing outside kvtier's files changed" (#13), checked by every row of the matrix: each row
//! points `disk.dir` at a `/tmp`-like directory (sticky, world-writable, holding another
//! program's files) inside a private tree, snapshots that tree (every entry's path, type, mode,
//! length and content) before the engine starts and compares after it shut down. Only kvtier's
//! own subdirectory of `disk.dir` (`kvtier-g3/`, see `kvtier_io::storage::disk::dir`) may differ.
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// kvtier's own file set under `disk.dir` (`kvtier_io::storage::disk::dir::SUBDIR`).
const KVTIER_SUBDIR: &str = "kvtier-g3";

#[derive(Debug, PartialEq, Eq)]
struct Entry {
    kind: &'static str,
    mode: u32,
    content: Vec<u8>,
}

type Snapshot = BTreeMap<PathBuf, Entry>;

/// A private tree around a shared `disk.dir`; see the module docs.
pub(crate) struct Sandbox {
    root: tempfile::TempDir,
    disk_dir: PathBuf,
    before: Snapshot,
}

impl Sandbox {
    pub(crate) fn new() -> Sandbox {
        let root = tempfile::tempdir().unwrap();
        let disk_dir = root.path().join("shared");
        let sub = disk_dir.join("other-app");
        std::fs::create_dir_all(&sub).unwrap();
        let file = |p: &Path, body: &[u8], mode: u32| {
            std::fs::write(p, body).unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        file(&disk_dir.join("foreign.txt"), b"not kvtier's", 0o644);
        file(&sub.join("state"), b"another program's state", 0o600);
        file(&root.path().join("sibling"), b"next to disk.dir", 0o640);
        std::os::unix::fs::symlink("foreign.txt", disk_dir.join("link")).unwrap();
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        mode(&sub, 0o750);
        // Like /tmp: sticky and world-writable (the #13 finding: `kvtier serve` chmodded it).
        mode(&disk_dir, 0o1777);
        let before = snapshot(root.path());
        Sandbox {
            root,
            disk_dir,
            before,
        }
    }

    /// What the row sets `disk.dir` to.
    pub(crate) fn disk_dir(&self) -> &Path {
        &self.disk_dir
    }

    /// Asserts that everything outside kvtier's own files is as it was.
    pub(crate) fn assert_untouched(&self) {
        let after = snapshot(self.root.path());
        for (p, e) in &self.before {
            assert_eq!(
                after.get(p),
                Some(e),
                "{} changed outside kvtier's files",
                p.display()
            );
        }
        for p in after.keys() {
            assert!(
                self.before.contains_key(p),
                "{} appeared outside kvtier's files",
                p.display()
            );
        }
    }
}

fn snapshot(root: &Path) -> Snapshot {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = std::fs::symlink_metadata(&p).unwrap();
        let rel = p.strip_prefix(root).unwrap().to_path_buf();
        let (kind, content) = if md.file_type().is_symlink() {
            let target = std::fs::read_link(&p).unwrap();
            ("symlink", target.into_os_string().into_encoded_bytes())
        } else if md.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                if e.file_name() == KVTIER_SUBDIR && p.file_name() == Some("shared".as_ref()) {
                    continue;
                }
                stack.push(e.path());
            }
            ("dir", Vec::new())
        } else {
            ("file", std::fs::read(&p).unwrap())
        };
        out.insert(
            rel,
            Entry {
                kind,
                mode: md.permissions().mode() & 0o7777,
                content,
            },
        );
    }
    out
}
