//! Where the disk tier puts its files and what it may change there: kvtier's own subdirectory
//! of `disk.dir`, never a chmod of a directory kvtier did not create.
#![allow(clippy::unwrap_used)]
use std::os::unix::fs::PermissionsExt;

use kvtier_io::*;

fn mode(p: &std::path::Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Regression (#13): `disk.dir` pointing at a /tmp-like directory (sticky, world-writable)
/// lost its mode to a chmod 0700. Now its mode is left exactly as it was, and the files go into
/// kvtier's own 0700 subdirectory.
#[test]
fn shared_disk_dir_keeps_its_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("shared-tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let d = DiskStorage::create(&DiskOptions::new(&shared, 4, 4096)).unwrap();
    assert_eq!(mode(&shared), 0o1777, "disk.dir's mode was changed");
    assert_eq!(d.dir(), shared.join(SUBDIR));
    assert_eq!(mode(d.dir()), 0o700);
    for p in d.file_paths() {
        assert!(p.starts_with(shared.join(SUBDIR)));
        assert_eq!(mode(&p), 0o600);
    }
    drop(d);
    assert_eq!(mode(&shared), 0o1777);
    // A second start re-uses the subdirectory without touching either mode.
    let d = DiskStorage::create(&DiskOptions::new(&shared, 4, 4096)).unwrap();
    assert_eq!(mode(&shared), 0o1777);
    assert_eq!(mode(d.dir()), 0o700);
}

/// A `disk.dir` that does not exist is created by kvtier, so it gets kvtier's mode (0700).
#[test]
fn missing_disk_dir_is_created_private() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a/b");
    let d = DiskStorage::create(&DiskOptions::new(&dir, 2, 4096)).unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(d.dir()), 0o700);
}

/// A subdirectory others may write into (or that is a symlink) is refused, not chmodded:
/// someone else could swap kvtier's files.
#[test]
fn unsafe_subdirectory_is_refused_and_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let sub = tmp.path().join(SUBDIR);
    std::fs::create_dir(&sub).unwrap();
    std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = DiskStorage::create(&DiskOptions::new(tmp.path(), 2, 4096)).unwrap_err();
    assert!(e.to_string().contains("lets others write"), "{e}");
    assert_eq!(mode(&sub), 0o777, "a refused directory keeps its mode");
    std::fs::remove_dir(&sub).unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &sub).unwrap();
    let e = DiskStorage::create(&DiskOptions::new(tmp.path(), 2, 4096)).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
}

/// A file set name that could leave the subdirectory is a configuration error.
#[test]
fn path_like_names_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["../x", "a/b", ".hidden", ""] {
        let mut o = DiskOptions::new(tmp.path(), 2, 4096);
        o.name = bad.into();
        assert!(
            matches!(DiskStorage::create(&o), Err(IoError::Config(_))),
            "{bad:?}"
        );
    }
}
