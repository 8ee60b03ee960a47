//! Command-line and configuration errors are one message naming the setting, exit status 2.
//! Regression (#28): a configuration error printed a 50-frame backtrace under `RUST_BACKTRACE=1`
//! and exited 1 like any failure.
#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn configuration_error_is_one_message_and_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("inspect")
        .env("RUST_BACKTRACE", "1")
        .env("KVTIER_HOST_GB", "lots")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("configuration error"), "{err}");
    assert!(err.contains("KVTIER_HOST_GB"), "{err}");
    assert!(
        !err.contains("Stack backtrace") && !err.contains("stack backtrace"),
        "{err}"
    );
    assert!(err.lines().count() <= 3, "{err}");
}

/// `kvtier node --huge-pages` takes `advise` or `collapse` only: anything else is a usage error
/// (exit 2) naming the flag and the values, before any socket or arena is made.
#[test]
fn node_huge_pages_takes_advise_or_collapse() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "node",
            "--capacity-gb",
            "0.01",
            "--huge-pages",
            "always",
            "--socket",
        ])
        .arg(dir.path().join("n.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--huge-pages") && err.contains("collapse"),
        "{err}"
    );
    assert!(!dir.path().join("n.sock").exists());
}
