//! `kvtier serve` and signals, with the built binary (#13): the first SIGTERM shuts down within
//! the grace period even while a client holds a half-sent request; a second signal exits at once.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn spawn(cache: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--host", "127.0.0.1", "--port", "0"])
        .args(["--num-device-blocks", "64", "--max-batch-tokens", "128"])
        .args(["--connector", "none"])
        .env("XDG_CACHE_HOME", cache)
        .env_remove("KVTIER_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
            }
        }
    });
    let addr = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(a) => a,
        Err(_) => {
            let _ = child.kill();
            panic!("server did not start");
        }
    };
    (child, addr)
}

fn term(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

fn wait(child: &mut Child, bound: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Regression (#13, hangs): SIGTERM never completed while a client held a half-sent request,
/// and a second signal was ignored.
#[test]
fn second_sigterm_exits_at_once_while_a_request_is_half_sent() {
    let cache = tempfile::tempdir().unwrap();
    let (mut child, addr) = spawn(cache.path());
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    term(&child);
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "exited before the grace period");
    term(&child);
    let status = wait(&mut child, Duration::from_secs(3)).expect("second signal did not exit");
    assert_eq!(status.code(), Some(130));
    drop(c);
}

#[test]
fn first_sigterm_exits_within_the_grace_period() {
    let cache = tempfile::tempdir().unwrap();
    let (mut child, addr) = spawn(cache.path());
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    term(&child);
    // Grace period 10 s, plus the engine's shutdown.
    let status = wait(&mut child, Duration::from_secs(15)).expect("SIGTERM did not complete");
    assert!(status.success(), "{status:?}");
    drop(c);
}
