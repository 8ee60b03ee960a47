//! Test support: a private `redis-server` per test, on a free loopback port, in a temp dir, with
//! persistence off; killed when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub(crate) struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    extra: Vec<String>,
}

fn find_redis_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVTIER_REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl RedisServer {
    /// Starts a server, or returns `None` when `redis-server` is absent and `KVTIER_SKIP_REDIS=1`.
    /// Without that variable a missing binary fails the test.
    pub(crate) fn start() -> Option<RedisServer> {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with extra `redis-server` arguments; `{free_port}` in an argument
    /// is replaced by another free port.
    pub(crate) fn start_with(extra: &[&str]) -> Option<RedisServer> {
        let Some(bin) = find_redis_server() else {
            if std::env::var("KVTIER_SKIP_REDIS").as_deref() == Ok("1") {
                eprintln!("redis-server not found; skipped because KVTIER_SKIP_REDIS=1");
                return None;
            }
            panic!(
                "redis-server not found in PATH: install it (apt-get install redis-server, or run \
                 scripts/start-services.sh) or set KVTIER_SKIP_REDIS=1 to skip the Redis tests"
            );
        };
        let mut last_err = None;
        for _ in 0..5 {
            let mut s = RedisServer {
                child: None,
                port: free_port().expect("free port"),
                dir: tempfile::tempdir().expect("temp dir for redis-server"),
                bin: bin.clone(),
                extra: extra
                    .iter()
                    .map(|a| a.replace("{free_port}", &free_port().expect("free port").to_string()))
                    .collect(),
            };
            match s.spawn() {
                Ok(()) => return Some(s),
                Err(e) => last_err = Some(e),
            }
        }
        panic!("could not start redis-server: {last_err:?}");
    }

    /// (Re)starts the server process on `self.port` and waits until it answers PING.
    pub(crate) fn spawn(&mut self) -> Result<()> {
        let child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawn redis-server")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = self.raw() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return Ok(());
                }
            }
            if let Some(ch) = self.child.as_mut() {
                if let Some(status) = ch.try_wait()? {
                    self.child = None;
                    bail!("redis-server exited at start: {status}");
                }
            }
            if Instant::now() > deadline {
                self.kill();
                bail!("redis-server did not answer within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A raw connection (no kvtier framing), for inspecting and damaging values.
    pub(crate) fn raw(&self) -> Result<redis::Connection> {
        let c = redis::Client::open(self.url())?
            .get_connection_with_timeout(Duration::from_millis(500))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(c)
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends a signal (e.g. "STOP", "CONT") to the server process.
    pub(crate) fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let ok = Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "kill -{sig} {pid} failed");
        }
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped process must be continued to die promptly on SIGKILL; harmless otherwise.
        self.kill();
    }
}

/// Deterministic pseudo-random bytes (xorshift), distinct per seed.
pub(crate) fn block(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A Redis Cluster of `n` masters (no replicas) on loopback, each a [`RedisServer`].
pub(crate) struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub(crate) fn start(n: usize) -> Option<RedisCluster> {
        let mut nodes = Vec::new();
        for _ in 0..n {
            nodes.push(RedisServer::start_with(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                "{free_port}",
            ])?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create (package redis-tools)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            loop {
                let info: String = node
                    .raw()
                    .and_then(|mut c| Ok(redis::cmd("CLUSTER").arg("INFO").query(&mut c)?))
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster did not become ok: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(RedisCluster { nodes })
    }

    /// `redis://h1:p1,h2:p2,...?cluster=1`
    pub(crate) fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis://{}?cluster=1", hosts.join(","))
    }

    /// The node that holds `name` (by asking any node for the key's slot owner).
    pub(crate) fn owner_of(&self, name: &str) -> &RedisServer {
        let mut c = self.nodes[0].raw().expect("raw connection");
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(name)
            .query(&mut c)
            .expect("CLUSTER KEYSLOT");
        let slots: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut c)
            .expect("CLUSTER SLOTS");
        let redis::Value::Array(ranges) = slots else {
            panic!("CLUSTER SLOTS: {slots:?}")
        };
        for r in ranges {
            let redis::Value::Array(r) = r else { continue };
            let (Some(redis::Value::Int(lo)), Some(redis::Value::Int(hi))) = (r.first(), r.get(1))
            else {
                continue;
            };
            if (*lo..=*hi).contains(&slot) {
                if let Some(redis::Value::Array(master)) = r.get(2) {
                    if let Some(redis::Value::Int(port)) = master.get(1) {
                        return self
                            .nodes
                            .iter()
                            .find(|n| i64::from(n.port) == *port)
                            .expect("owner is one of ours");
                    }
                }
            }
        }
        panic!("no owner for slot {slot}");
    }
}
