//! Remote-store rows: a private `redis-server` killed, killed and restarted (flapping),
//! SIGSTOPped, or with every value replaced by another key's (forged).
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier::metrics::render_prometheus;
use kvtier_engine::{EngineConfig, EngineHandle, Prefilled, Role};

use super::common::{collect, prompts, reference, request};
use super::outside::Sandbox;
use super::{engine, IDLE};

/// A private `redis-server` on a free port, killed on drop.
struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Option<Redis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Redis::start_on(port)
    }

    fn start_on(port: u16) -> Option<Redis> {
        if Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            assert_eq!(
                std::env::var("KVTIER_SKIP_REDIS").as_deref(),
                Ok("1"),
                "redis-server not found (scripts/start-services.sh) and KVTIER_SKIP_REDIS is not 1"
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let r = Redis {
            child,
            port,
            _dir: dir,
        };
        let t0 = Instant::now();
        while r.cli(&["PING"]) != "PONG" {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(r)
    }
    fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
    fn url(&self) -> String {
        format!(
            "redis://127.0.0.1:{}?io_timeout_ms=300&lookup_timeout_ms=100&connect_timeout_ms=200&backoff_ms=200&max_backoff_ms=400",
            self.port
        )
    }
    /// Kills the server (its data is gone: no persistence).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A prefill engine publishes every prompt to the remote store at `url`, `fault` runs, then a
/// decode engine continues each request from the store: the outputs must equal the reference.
/// Returns the decode engine's metrics and how long the decode phase took.
fn disagg_with_fault(url: &str, fault: impl FnOnce()) -> (kvtier_engine::EngineMetrics, Duration) {
    let sb = Sandbox::new();
    let ps = prompts(6, 64);
    let max_tokens = 6;
    let want = reference(EngineConfig::builtin(45), &ps, max_tokens);
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(256));
    kv.remote = Some(RemoteTarget::parse(url).expect("a valid redis url"));
    kv.disk.dir = sb.disk_dir().to_path_buf();
    kv.validate().unwrap();
    let mut pc = engine(45, kv.clone(), None);
    pc.role = Role::Prefill;
    let mut dc = engine(45, kv, None);
    dc.role = Role::Decode;
    let prefill = EngineHandle::start(pc).unwrap();
    let firsts: Vec<u32> = ps
        .iter()
        .map(|p| prefill.submit(request(p, max_tokens)).unwrap())
        .collect::<Vec<_>>()
        .into_iter()
        .map(|rx| collect(rx).0[0])
        .collect();
    assert!(prefill.wait_idle(IDLE));
    prefill.shutdown();
    fault();
    let decode = EngineHandle::start(dc).unwrap();
    let t0 = Instant::now();
    let got: Vec<_> = ps
        .iter()
        .zip(&firsts)
        .map(|(p, &t)| {
            let mut r = request(p, max_tokens);
            r.prefilled = Some(Prefilled { first_token: t });
            decode.submit(r).unwrap()
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(collect)
        .collect();
    let took = t0.elapsed();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[i].0, w, "request {i} after the remote fault");
    }
    let m = decode.metrics();
    decode.shutdown();
    sb.assert_untouched();
    (m, took)
}

/// Control row: the healthy store really serves the decode engine (so the rows below test the
/// remote path).
#[test]
fn remote_healthy_serves_the_decode_engine() {
    let Some(r) = Redis::start() else { return };
    let (m, _) = disagg_with_fault(&r.url(), || {});
    assert!(m.kvtier_matched_tokens_remote > 0, "{m:?}");
    assert_eq!(m.load_failures, 0, "{m:?}");
    assert_eq!(
        m.kvtier.remote,
        Default::default(),
        "a healthy store tripped"
    );
}

/// Redis down (killed before the decode engine starts): misses, recomputed, bounded time.
#[test]
fn remote_down_is_recomputed_identically_within_the_bound() {
    let Some(mut r) = Redis::start() else { return };
    let url = r.url();
    let (m, took) = disagg_with_fault(&url, || r.kill());
    assert_eq!(m.kvtier_matched_tokens_remote, 0, "{m:?}");
    assert!(m.kvtier.remote.breaker_opened >= 1, "{:?}", m.kvtier.remote);
    assert!(
        took < Duration::from_secs(20),
        "decode took {took:?} against a dead store"
    );
}

/// Redis stops answering (SIGSTOP) before the decode engine starts: every lookup fails within
/// `lookup_timeout`, the breaker short-circuits the rest, outputs identical, bounded time.
#[test]
fn remote_stalled_is_recomputed_identically_within_the_bound() {
    let Some(r) = Redis::start() else { return };
    let (m, took) = disagg_with_fault(&r.url(), || r.signal("STOP"));
    r.signal("CONT");
    // #13 item 1: the deadline and the breaker are visible in the metrics (the one table).
    let h = m.kvtier.remote;
    assert!(h.deadline_expired >= 1, "{h:?}");
    assert!(h.breaker_opened >= 1, "{h:?}");
    assert!(h.short_circuited >= 1, "{h:?}");
    let text = render_prometheus(std::slice::from_ref(&m.kvtier));
    for (name, v) in [
        ("kvtier_remote_deadline_expired_total", h.deadline_expired),
        ("kvtier_remote_breaker_opened_total", h.breaker_opened),
        ("kvtier_remote_short_circuited_total", h.short_circuited),
        ("kvtier_remote_breaker_probes_total", h.breaker_probes),
    ] {
        assert!(
            text.contains(&format!("\n{name} {v}\n")),
            "{name} {v}: {text}"
        );
    }
    assert!(
        took < Duration::from_secs(20),
        "decode took {took:?} against a stalled store"
    );
}

/// Forged values: every kvtier value is overwritten by a copy of another block's value (the
/// #13 forgery): none is served, all recomputed, identically.
#[test]
fn remote_forged_values_are_rejected_and_recomputed_identically() {
    let Some(r) = Redis::start() else { return };
    let (m, _) = disagg_with_fault(&r.url(), || {
        let keys: Vec<String> = r
            .cli(&["--scan", "--pattern", "kvtier:*"])
            .lines()
            .map(str::to_string)
            .collect();
        assert!(keys.len() > 1, "nothing was published: {keys:?}");
        // Rotate: every key receives the value of another key.
        let n = keys.len();
        assert_eq!(
            r.cli(&["COPY", &keys[n - 1], "kvtier-fuzz-tmp", "REPLACE"]),
            "1"
        );
        for i in (1..n).rev() {
            assert_eq!(r.cli(&["COPY", &keys[i - 1], &keys[i], "REPLACE"]), "1");
        }
        assert_eq!(
            r.cli(&["COPY", "kvtier-fuzz-tmp", &keys[0], "REPLACE"]),
            "1"
        );
    });
    assert!(m.load_failures > 0, "no forged value was detected: {m:?}");
}

/// Redis flapping: up, killed, restarted on the same port (empty: no persistence) while one
/// prefill engine keeps serving; a decode engine then continues every request. Every output
/// equals the reference; the breaker opened while the server was down, a probe closed it after
/// the restart, and what was published after the restart is served to the decode engine.
#[test]
fn remote_flapping_is_recomputed_identically_and_recovers() {
    let Some(mut r) = Redis::start() else { return };
    let sb = Sandbox::new();
    let ps = prompts(9, 64);
    let max_tokens = 6;
    let want = reference(EngineConfig::builtin(46), &ps, max_tokens);
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(256));
    kv.remote = Some(RemoteTarget::parse(&r.url()).unwrap());
    kv.disk.dir = sb.disk_dir().to_path_buf();
    kv.validate().unwrap();
    let mut pc = engine(46, kv.clone(), None);
    pc.role = Role::Prefill;
    let mut dc = engine(46, kv, None);
    dc.role = Role::Decode;
    let prefill = EngineHandle::start(pc).unwrap();
    let mut firsts = Vec::new();
    let mut phase = |range: std::ops::Range<usize>| {
        let rxs: Vec<_> = range
            .clone()
            .map(|i| prefill.submit(request(&ps[i], max_tokens)).unwrap())
            .collect();
        for (i, rx) in range.zip(rxs) {
            let t = collect(rx).0[0];
            assert_eq!(t, want[i][0], "prefill of request {i}");
            firsts.push(t);
        }
        assert!(prefill.wait_idle(IDLE));
        prefill.metrics()
    };
    let up = phase(0..3);
    assert!(up.offloaded_remote_blocks > 0, "{up:?}");
    let port = r.port;
    r.kill();
    let down = phase(3..6);
    assert!(down.kvtier.remote.breaker_opened >= 1, "{:?}", down.kvtier);
    assert_eq!(
        down.offloaded_remote_blocks, up.offloaded_remote_blocks,
        "a put to a dead server was confirmed"
    );
    r = Redis::start_on(port).unwrap();
    // Past the longest breaker window of the URL (max_backoff_ms=400).
    std::thread::sleep(Duration::from_millis(600));
    let back = phase(6..9);
    let h = back.kvtier.remote;
    assert!(!h.breaker_open && h.breaker_probes >= 1, "{h:?}");
    assert!(
        back.offloaded_remote_blocks > down.offloaded_remote_blocks,
        "nothing published after the restart: {back:?}"
    );
    let text = render_prometheus(std::slice::from_ref(&back.kvtier));
    assert!(
        text.contains(&format!(
            "\nkvtier_remote_breaker_probes_total {}\n",
            h.breaker_probes
        )) && text.contains("\nkvtier_remote_breaker_open 0\n"),
        "{text}"
    );
    prefill.shutdown();
    let decode = EngineHandle::start(dc).unwrap();
    let got: Vec<_> = ps
        .iter()
        .zip(&firsts)
        .map(|(p, &t)| {
            let mut q = request(p, max_tokens);
            q.prefilled = Some(Prefilled { first_token: t });
            decode.submit(q).unwrap()
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(collect)
        .collect();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[i].0, w, "request {i} after the flapping");
    }
    let m = decode.metrics();
    assert!(m.kvtier_matched_tokens_remote > 0, "{m:?}");
    decode.shutdown();
    drop(r);
    sb.assert_untouched();
}
