//! The leader <-> worker channel over ZeroMQ: a leader and two worker processes (TP=2, this test
//! binary re-executed as `zmq_worker_process`) on host memory; plus handshake failures.
#![cfg(feature = "zmq")]
#![allow(clippy::unwrap_used)]
use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::connector::testing::MemoryTransfer;
use kvtier::connector::zmq::{encode_with_version, LeaderChannel, Wire, WorkerChannel};
use kvtier::connector::{
    Capacity, ConnectorError, Leader, LeaderConfig, RankLayout, SchedulerStep, StepRecord, Worker,
    WorkerLink,
};
use kvtier::hash::HashSalt;
use kvtier::transfer::BlockTransfer;
use kvtier::{DeviceBlockId, RequestId, Tier};

const BS: u32 = 16;
const DEV: u32 = 64;
const ENDPOINT: &str = "KVTIER_ZMQ_TEST_ENDPOINT";
const RANK: &str = "KVTIER_ZMQ_TEST_RANK";
/// Set for a worker process that dies (exits without a word) on the first step with stores,
/// before it runs them: a rank killed mid-transfer.
const DIE: &str = "KVTIER_ZMQ_TEST_DIE";
/// Set for the survivor of that test: it onboards nothing, so it checks no count at the end.
const SURVIVOR: &str = "KVTIER_ZMQ_TEST_SURVIVOR";

fn bpb(rank: u32) -> usize {
    64 * (rank as usize + 1)
}

/// The KV a "forward pass" leaves in device block `d` on `rank`.
fn fill(rank: u32, d: u32) -> Vec<u8> {
    (0..bpb(rank))
        .map(|i| (d as usize * 31 + i * 7 + rank as usize * 13) as u8)
        .collect()
}

fn layout(rank: u32, block_size: u32) -> RankLayout {
    RankLayout {
        rank,
        world_size: 2,
        block_size,
        bytes_per_block: bpb(rank) as u64,
        num_device_blocks: DEV,
    }
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn zmq_worker_process() {
    let Ok(endpoint) = std::env::var(ENDPOINT) else {
        return;
    };
    let rank: u32 = std::env::var(RANK).unwrap().parse().unwrap();
    let mem = Arc::new(MemoryTransfer::new(bpb(rank), DEV as usize, 32, 0));
    let chan =
        WorkerChannel::connect(&endpoint, layout(rank, BS), Duration::from_secs(30)).unwrap();
    assert_eq!(chan.layout().bytes_per_block, vec![64, 128]);
    let mut worker = Worker::new(
        mem.clone() as Arc<dyn BlockTransfer>,
        WorkerLink::new(rank, 2, chan.sink()),
    );
    // host block -> the device block whose KV it received
    let mut origin: HashMap<u32, u32> = HashMap::new();
    let mut verified = 0;
    while let Some(meta) = chan.recv_step(Duration::from_secs(60)).unwrap() {
        if std::env::var(DIE).is_ok() && !meta.stores.is_empty() {
            std::process::exit(9);
        }
        worker.bind(&meta);
        worker.start_load(None);
        worker.wait_for_layer_load(0);
        for l in &meta.loads {
            for j in &l.jobs {
                assert_eq!(j.src_tier(), Tier::Host);
                for (src, dst) in j.pairs() {
                    let (src, dst) = (src.number().unwrap(), dst.number().unwrap());
                    let want = fill(rank, origin[&src]);
                    assert_eq!(
                        mem.read_block(Tier::Device, dst).unwrap(),
                        want,
                        "rank {rank} device {dst}"
                    );
                    verified += 1;
                }
            }
        }
        for s in &meta.stores {
            for (src, dst) in s.job.pairs() {
                let (src, dst) = (src.number().unwrap(), dst.number().unwrap());
                mem.write_block(Tier::Device, src, &fill(rank, src))
                    .unwrap();
                origin.insert(dst, src);
            }
        }
        worker.forward_done(None);
        worker.wait_idle();
        assert!(worker.take_load_errors().is_empty());
    }
    if std::env::var(SURVIVOR).is_err() {
        assert_eq!(verified, 6, "rank {rank} verified every onboarded block");
    }
    drop(worker);
}

fn spawn_worker(endpoint: &str, rank: u32) -> Child {
    spawn_worker_with(endpoint, rank, &[])
}

fn spawn_worker_with(endpoint: &str, rank: u32, env: &[(&str, &str)]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .envs(env.iter().copied())
        .args([
            "--exact",
            "zmq_worker_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENDPOINT, endpoint)
        .env(RANK, rank.to_string())
        .spawn()
        .unwrap()
}

fn wait_child(mut c: Child, timeout: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > timeout {
            let _ = c.kill();
            panic!("worker process did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for(leader: &mut Leader, what: &str, mut cond: impl FnMut(&mut Leader) -> bool) {
    let start = Instant::now();
    while !cond(leader) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}: {:?}",
            leader.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
        leader.poll_reports();
    }
}

fn rec(
    req: &str,
    tokens: Vec<u32>,
    blocks: Vec<DeviceBlockId>,
    computed: usize,
    scheduled: usize,
    new: bool,
) -> StepRecord {
    StepRecord {
        request_id: req.into(),
        new_tokens: tokens,
        new_block_ids: blocks,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        is_new: new,
        ..Default::default()
    }
}

/// The leader of a TP=2 engine whose two ranks are connecting to `chan`: 20 host blocks.
fn tp2_leader(chan: &LeaderChannel) -> Leader {
    let layout = chan.handshake(2, BS, Duration::from_secs(60)).unwrap();
    assert_eq!(layout.total_bytes_per_block(), 192);
    let mut cfg = LeaderConfig::new(BS as usize, HashSalt(9), 0);
    cfg.host = Capacity::Bytes(192 * 20);
    cfg.layout = Some(layout);
    let leader = Leader::new(cfg).unwrap();
    chan.attach(leader.report_sender()).unwrap();
    leader
}

/// Request "a" (100 tokens, device blocks 0..7) computes its first 64 tokens: 4 full blocks
/// stored by each rank.
fn prefill_a(leader: &mut Leader, chan: &LeaderChannel, prompt: &[u32]) -> RequestId {
    let ids = |r: std::ops::Range<u32>| r.map(DeviceBlockId).collect::<Vec<_>>();
    let a: RequestId = "a".into();
    assert_eq!(leader.get_num_new_matched_tokens(&a, prompt, 0).unwrap(), 0);
    leader
        .update_state_after_alloc(&a, &ids(0..7), Some(0))
        .unwrap();
    let s1 = SchedulerStep {
        records: vec![rec("a", prompt.to_vec(), ids(0..7), 0, 64, true)],
        finished: vec![],
    };
    chan.broadcast(&leader.build_step(&s1).unwrap()).unwrap();
    a
}

#[test]
fn leader_and_two_worker_processes_tp2() {
    let chan = LeaderChannel::bind("tcp://127.0.0.1:0").unwrap();
    let children = [
        spawn_worker(chan.endpoint(), 0),
        spawn_worker(chan.endpoint(), 1),
    ];
    let mut leader = tp2_leader(&chan);
    assert_eq!(
        leader.stats().host_capacity,
        20,
        "capacity derived from the ranks' summed bytes per block"
    );
    let prompt: Vec<u32> = (0..100).collect();
    let ids = |r: std::ops::Range<u32>| r.map(DeviceBlockId).collect::<Vec<_>>();
    let a = prefill_a(&mut leader, &chan, &prompt);
    let s2 = SchedulerStep {
        records: vec![rec("a", vec![], vec![], 64, 36, false)],
        finished: vec![],
    };
    chan.broadcast(&leader.build_step(&s2).unwrap()).unwrap();
    assert!(
        leader.request_finished(&a).unwrap().must_wait() || leader.stats().offload_confirmed == 6
    );
    wait_for(&mut leader, "6 confirmed stores", |l| {
        l.stats().offload_confirmed == 6
    });
    assert!(!leader.has_pending_saves(&a));

    let b: RequestId = "b".into();
    assert_eq!(
        leader.get_num_new_matched_tokens(&b, &prompt, 0).unwrap(),
        96
    );
    leader
        .update_state_after_alloc(&b, &ids(20..27), None)
        .unwrap();
    let s3 = SchedulerStep {
        records: vec![rec("b", prompt.clone(), ids(20..27), 0, 4, true)],
        finished: vec![],
    };
    let meta = leader.build_step(&s3).unwrap();
    assert_eq!(meta.loads.len(), 1);
    chan.broadcast(&meta).unwrap();
    wait_for(&mut leader, "loads reported by both ranks", |l| {
        l.stats().jobs_in_flight == 0
    });
    assert_eq!(leader.host_pool().unwrap().num_pinned(), 0);
    chan.shutdown();
    for c in children {
        assert!(
            wait_child(c, Duration::from_secs(60)).success(),
            "worker process failed"
        );
    }
}

/// Fault matrix row "a worker process killed mid-transfer" (#13): TP=2, rank 1 dies on the step
/// whose stores it was about to run. Its half of every block never arrives, so no block of that
/// step is ever confirmed or matched (a block is visible only once every rank stored it); the
/// leader's calls keep returning at once, the request's blocks stay held (its stores are
/// unconfirmed), the surviving rank finishes its own jobs, and shutdown is bounded.
#[test]
fn a_worker_process_killed_mid_transfer_leaves_no_block_visible_and_nothing_hangs() {
    let chan = LeaderChannel::bind("tcp://127.0.0.1:0").unwrap();
    let survivor = spawn_worker_with(chan.endpoint(), 0, &[(SURVIVOR, "1")]);
    let dying = spawn_worker_with(chan.endpoint(), 1, &[(DIE, "1"), (SURVIVOR, "1")]);
    let mut leader = tp2_leader(&chan);
    let prompt: Vec<u32> = (0..100).collect();
    let a = prefill_a(&mut leader, &chan, &prompt);
    let status = wait_child(dying, Duration::from_secs(30));
    assert_eq!(status.code(), Some(9), "rank 1 died mid-transfer");

    // The leader goes on at once with a rank gone.
    let t = Instant::now();
    let s2 = SchedulerStep {
        records: vec![rec("a", vec![], vec![], 64, 36, false)],
        finished: vec![],
    };
    let meta = leader.build_step(&s2).unwrap();
    let _ = chan.broadcast(&meta); // to the dead rank: an error or a message nobody reads
    for _ in 0..50 {
        leader.poll_reports();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the leader stalled: {:?}",
        t.elapsed()
    );
    // Rank 0's stores landed, rank 1's never will: nothing is confirmed, nothing matches.
    assert_eq!(leader.stats().offload_confirmed, 0, "{:?}", leader.stats());
    let b: RequestId = "b".into();
    assert_eq!(
        leader.get_num_new_matched_tokens(&b, &prompt, 0).unwrap(),
        0,
        "a block half of whose ranks stored it was served"
    );
    assert!(
        leader.request_finished(&a).unwrap().must_wait(),
        "the engine must keep blocks whose stores are unconfirmed"
    );
    let t = Instant::now();
    chan.shutdown();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert!(
        wait_child(survivor, Duration::from_secs(60)).success(),
        "the surviving worker process failed"
    );
}

#[test]
fn layout_mismatch_is_refused_on_both_sides() {
    let chan = LeaderChannel::bind("tcp://127.0.0.1:0").unwrap();
    let ep = chan.endpoint().to_owned();
    let workers: Vec<_> = [(0, BS), (1, 32)]
        .into_iter()
        .map(|(rank, bs)| {
            let ep = ep.clone();
            std::thread::spawn(move || {
                WorkerChannel::connect(&ep, layout(rank, bs), Duration::from_secs(30)).err()
            })
        })
        .collect();
    let e = chan.handshake(2, BS, Duration::from_secs(30)).unwrap_err();
    assert!(matches!(e, ConnectorError::Handshake(_)));
    assert!(
        e.to_string().contains("rank 1 has 32 tokens per block"),
        "{e}"
    );
    for w in workers {
        let we = w.join().unwrap().expect("the worker must be refused");
        assert!(
            we.to_string().contains("rank 1 has 32 tokens per block"),
            "{we}"
        );
    }
}

#[test]
fn handshake_times_out_naming_the_missing_ranks() {
    let chan = LeaderChannel::bind("tcp://127.0.0.1:0").unwrap();
    let ep = chan.endpoint().to_owned();
    let w = std::thread::spawn(move || {
        WorkerChannel::connect(&ep, layout(0, BS), Duration::from_secs(2)).err()
    });
    let e = chan
        .handshake(2, BS, Duration::from_millis(800))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2 ranks"), "{e}");
    assert!(
        w.join().unwrap().is_some(),
        "the lone worker gets no welcome"
    );
}

/// A peer speaking another wire version is refused by name; it does not fail (or block) the
/// leader's handshake, which still names it when it times out.
#[test]
fn other_protocol_version_is_refused_by_name() {
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
    let chan = LeaderChannel::bind("tcp://127.0.0.1:0").unwrap();
    let ep = chan.endpoint().to_owned();
    let peer = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut s = DealerSocket::new();
            s.connect(&ep).await.unwrap();
            let hello = encode_with_version(99, &Wire::Shutdown).unwrap();
            s.send(ZmqMessage::from(hello)).await.unwrap();
            let answer = s.recv().await.unwrap();
            let bytes = answer.into_vec().pop().unwrap().to_vec();
            kvtier::connector::zmq::decode(&bytes).unwrap()
        })
    });
    match peer.join().unwrap() {
        Wire::Reject(reason) => assert!(reason.contains("version 99"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    let e = chan
        .handshake(1, BS, Duration::from_millis(500))
        .unwrap_err();
    assert!(e.to_string().contains("0 of 1 ranks"), "{e}");
    assert!(e.to_string().contains("version 99"), "{e}");
}

/// Regression (#13, security): the channel had no authentication; a local process joined as rank
/// 0 and locked the real worker out. A peer without the deployment's secret is refused (and told
/// why), is not counted, and the real rank still joins.
#[test]
fn unauthenticated_peer_is_refused_and_the_real_rank_joins() {
    use kvtier::connector::zmq_auth::ChannelSecret;
    let secret = ChannelSecret::new(b"deployment secret of this test".to_vec()).unwrap();
    let chan = LeaderChannel::bind_with("tcp://127.0.0.1:0", Some(secret.clone())).unwrap();
    let ep = chan.endpoint().to_owned();
    let single = RankLayout {
        world_size: 1,
        ..layout(0, BS)
    };
    let wrong = ChannelSecret::new(b"a guess at the secret, wrong".to_vec()).unwrap();
    let intruder =
        WorkerChannel::connect_with(&ep, single.clone(), Duration::from_secs(5), Some(wrong))
            .err()
            .expect("an intruder with the wrong secret was welcomed");
    assert!(
        intruder.to_string().contains("authentication failed"),
        "{intruder}"
    );
    let w = {
        let ep = ep.clone();
        let single = single.clone();
        std::thread::spawn(move || {
            WorkerChannel::connect_with(&ep, single, Duration::from_secs(20), Some(secret))
                .map(|c| c.layout().clone())
        })
    };
    let agreed = chan.handshake(1, BS, Duration::from_secs(20)).unwrap();
    assert_eq!(w.join().unwrap().unwrap(), agreed);
}

/// Without KVTIER_ZMQ_SECRET, the leader's key file (private to this user) carries the secret to
/// ranks on this host; a rank started before the leader waits for it.
#[test]
fn key_file_secret_reaches_a_rank_started_first() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ep = format!("tcp://127.0.0.1:{port}");
    let single = RankLayout {
        world_size: 1,
        ..layout(0, BS)
    };
    let w = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            WorkerChannel::connect(&ep, single, Duration::from_secs(20)).map(|c| c.layout().clone())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let chan = LeaderChannel::bind(&ep).unwrap();
    let key = kvtier::connector::zmq_auth::key_file(&ep).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let agreed = chan.handshake(1, BS, Duration::from_secs(20)).unwrap();
    assert_eq!(w.join().unwrap().unwrap(), agreed);
    chan.shutdown();
    assert!(!key.exists(), "the leader left its key file behind");
}

/// Regression (#13, panics): an `ipc://` leader endpoint, listed in docs/CONFIG.md, panicked
/// because the ZeroMQ transport was built TCP-only. It now works, the socket is mode 0600, a
/// stale socket file of a dead leader is reclaimed, and transports this build lacks are refused
/// with an error instead of a panic.
#[test]
fn ipc_endpoint_works_is_private_and_others_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leader.sock");
    // A stale socket file nobody listens on, as a killed leader leaves it.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let ep = format!("ipc://{}", path.display());
    let chan = LeaderChannel::bind(&ep).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "leader socket mode {mode:o}");
    let single = |rank| RankLayout {
        world_size: 1,
        ..layout(rank, BS)
    };
    let w = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            WorkerChannel::connect(&ep, single(0), Duration::from_secs(20))
                .map(|c| c.layout().clone())
        })
    };
    let agreed = chan.handshake(1, BS, Duration::from_secs(20)).unwrap();
    assert_eq!(w.join().unwrap().unwrap(), agreed);
    // A second leader on the live socket is an error, not a takeover.
    assert!(LeaderChannel::bind(&ep).is_err());
    for bad in ["inproc://kvtier", "ipc://", "udp://127.0.0.1:1"] {
        let e = LeaderChannel::bind(bad).err().expect("accepted");
        assert!(matches!(e, ConnectorError::Channel(_)), "{bad}: {e}");
        let e = WorkerChannel::connect(bad, single(0), Duration::from_secs(1))
            .err()
            .expect("accepted");
        assert!(matches!(e, ConnectorError::Channel(_)), "{bad}: {e}");
    }
}

/// Regression (#28, security): with a fixed KVTIER_ZMQ_SECRET, a captured worker hello replayed
/// to a restarted leader was accepted as rank 0 and locked the real worker out (the hello had no
/// challenge from the leader). The hello now answers a challenge the leader issued to that peer:
/// the replay is refused (with or without asking for a challenge first), and the real rank joins.
#[test]
fn replayed_hello_is_refused_by_a_restarted_leader() {
    use kvtier::connector::zmq::{decode, encode, hello};
    use kvtier::connector::zmq_auth::ChannelSecret;
    use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
    let secret = ChannelSecret::new(b"fixed deployment secret of this test".to_vec()).unwrap();
    let single = RankLayout {
        world_size: 1,
        ..layout(0, BS)
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    async fn ask(s: &mut DealerSocket, w: &Wire) -> Wire {
        s.send(ZmqMessage::from(encode(w).unwrap())).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), s.recv())
            .await
            .expect("no answer from the leader")
            .unwrap();
        decode(&m.into_vec().pop().unwrap()).unwrap()
    }
    // The real worker's hello to the first leader, captured on the wire.
    let first = LeaderChannel::bind_with("tcp://127.0.0.1:0", Some(secret.clone())).unwrap();
    let ep = first.endpoint().to_owned();
    let captured = rt.block_on(async {
        let mut s = DealerSocket::new();
        s.connect(&ep).await.unwrap();
        let Wire::Challenge(c) = ask(&mut s, &Wire::Hi).await else {
            panic!("no challenge")
        };
        hello(&secret, &c, single.clone()).unwrap()
    });
    first.shutdown();
    // The leader restarts on the same endpoint; the attacker replays the hello.
    let leader = LeaderChannel::bind_with(&ep, Some(secret.clone())).unwrap();
    let answers = rt.block_on(async {
        let mut s = DealerSocket::new();
        s.connect(&ep).await.unwrap();
        let direct = ask(&mut s, &captured).await;
        let Wire::Challenge(_) = ask(&mut s, &Wire::Hi).await else {
            panic!("no challenge")
        };
        let after_challenge = ask(&mut s, &captured).await;
        (direct, after_challenge)
    });
    for a in [answers.0, answers.1] {
        assert!(
            matches!(&a, Wire::Reject(r) if r.contains("authentication failed")),
            "a replayed hello was not refused: {a:?}"
        );
    }
    let w = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            WorkerChannel::connect_with(&ep, single, Duration::from_secs(20), Some(secret))
                .map(|c| c.layout().clone())
        })
    };
    let agreed = leader.handshake(1, BS, Duration::from_secs(20)).unwrap();
    assert_eq!(w.join().unwrap().unwrap(), agreed);
}
