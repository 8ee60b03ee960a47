//! The node tier across local users (issue 26, docs/arch/node.md "Trust"): a client attaches
//! only to a node of its own uid or one named by `node_uid`; the node lets in only its own uid
//! and `--allow-uid` ones (`SO_PEERCRED`), and each uid's namespaces are its own.
//!
//! The other user is `nobody` (65534): this test binary re-runs itself as that user (std's
//! `Command::uid`, which needs root) in one of the `child_*` roles below. Without root the
//! tests print why and pass; CI runs them as root.
#![allow(clippy::unwrap_used)]
use kvtier::hash::SequenceHash;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvtier::transfer::RemoteStore;
use kvtier_io::storage::node::{NodeClientOptions, NodeOptions, NodeServer, NodeStore};

const BLOCK: usize = 4096;
const NOBODY: u32 = 65534;

fn block(key: u128) -> Vec<u8> {
    (0..BLOCK).map(|i| (key as usize * 31 + i) as u8).collect()
}

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

/// Root, or a printed reason to skip.
fn root(dir: &Path) -> bool {
    let me = std::fs::metadata(dir).unwrap().uid();
    if me != 0 {
        println!("skipped: cross-user node tests need root (to run a child as uid {NOBODY})");
    }
    me == 0
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// This test binary, run as `nobody` in `role` with `vars`.
fn as_nobody(role: &str, vars: &[(&str, String)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([role, "--exact", "--nocapture", "--test-threads=1"])
        .env("KVTIER_TRUST_ROLE", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .uid(NOBODY)
        .gid(NOBODY);
    for (k, v) in vars {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// The child's `TRUST:` lines until it exits.
fn trust_lines(mut c: Child) -> Vec<String> {
    drop(c.stdin.take());
    let mut out = String::new();
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    assert!(c.wait().unwrap().success(), "child failed: {out}");
    out.lines()
        .filter_map(|l| l.find("TRUST:").map(|i| l[i + 6..].to_owned()))
        .collect()
}

/// The node arenas mapped in this process, and whether any holds `bytes` (read through
/// `/proc/self/mem`, as any process may read its own mappings).
fn scan_arenas(bytes: &[u8]) -> (usize, bool) {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mem = std::fs::File::open("/proc/self/mem").unwrap();
    let mut mapped = 0;
    let mut found = false;
    for l in maps.lines().filter(|l| {
        l.contains("kvtier-node-") && l.trim_end_matches(" (deleted)").ends_with(".arena")
    }) {
        let range = l.split_whitespace().next().unwrap();
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; (b - a) as usize];
        mem.read_exact_at(&mut buf, a).unwrap();
        mapped += 1;
        found |= buf.windows(bytes.len()).any(|w| w == bytes);
    }
    (mapped, found)
}

/// Role: a client of uid `nobody` that stores block 1 under `m`, looks for block 2 through the
/// node and through the arena memory it was given.
#[test]
fn child_client() {
    if env("KVTIER_TRUST_ROLE").as_deref() != Some("child_client") {
        return;
    }
    let sock = env("KVTIER_TRUST_SOCK").unwrap();
    let opts = NodeClientOptions {
        node_uids: vec![env("KVTIER_TRUST_NODE_UID").unwrap().parse().unwrap()],
        io_timeout: Duration::from_secs(2),
        ..NodeClientOptions::default()
    };
    match NodeStore::connect(Path::new(&sock), "m", opts) {
        Ok(s) => {
            println!("TRUST:attached");
            println!("TRUST:put={}", s.put(SequenceHash(1), &block(1)).is_ok());
            println!(
                "TRUST:sees-2={}",
                s.contains(&[SequenceHash(2)]).unwrap()[0]
            );
            // What an attacker would do next: read every arena mapped in this process.
            let (mapped, found) = scan_arenas(&block(2));
            println!("TRUST:arenas-mapped={mapped}");
            println!("TRUST:reads-2={found}");
        }
        Err(e) => println!("TRUST:refused {e}"),
    }
}

/// Role: a tenant of uid `nobody` that stores block 1, then tries to truncate the arena it
/// was passed (which would fault the node's mapping of it: SIGBUS, the node gone for everyone).
#[test]
fn child_truncator() {
    if env("KVTIER_TRUST_ROLE").as_deref() != Some("child_truncator") {
        return;
    }
    let opts = NodeClientOptions {
        node_uids: vec![0],
        ..NodeClientOptions::default()
    };
    let s = NodeStore::connect(Path::new(&env("KVTIER_TRUST_SOCK").unwrap()), "m", opts).unwrap();
    println!("TRUST:put={}", s.put(SequenceHash(1), &block(1)).is_ok());
    println!("TRUST:truncated={}", s.truncate_arena(0).is_ok());
}

/// Role: a tenant of uid `nobody` that attaches `KVTIER_TRUST_CONNS` times and holds every
/// connection until its stdin closes (one more is tried and reported).
#[test]
fn child_hog() {
    if env("KVTIER_TRUST_ROLE").as_deref() != Some("child_hog") {
        return;
    }
    let sock = env("KVTIER_TRUST_SOCK").unwrap();
    let n: usize = env("KVTIER_TRUST_CONNS").unwrap().parse().unwrap();
    let opts = NodeClientOptions {
        node_uids: vec![0],
        pool: 1,
        ..NodeClientOptions::default()
    };
    let held: Vec<NodeStore> = (0..n)
        .map(|_| NodeStore::connect(Path::new(&sock), "m", opts.clone()).unwrap())
        .collect();
    let more = NodeStore::connect(Path::new(&sock), "m", opts).is_ok();
    println!("TRUST:holding={} one-more={more}", held.len());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// Role: a node of uid `nobody` in `KVTIER_TRUST_DIR` that lets root attach, until its stdin
/// closes.
#[test]
fn child_node() {
    if env("KVTIER_TRUST_ROLE").as_deref() != Some("child_node") {
        return;
    }
    let dir = std::path::PathBuf::from(env("KVTIER_TRUST_DIR").unwrap());
    let mut o = NodeOptions::new(dir.join("node.sock"), 8 * BLOCK as u64);
    o.shm_dir = dir;
    o.allowed_uids = vec![0]; // root's engine may attach (if it accepts this node)
    let n = NodeServer::start(&o).unwrap();
    println!("TRUST:serving");
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(n);
}

#[test]
fn a_client_refuses_a_node_of_another_uid_unless_named_by_node_uid() {
    let top = tempfile::tempdir().unwrap();
    if !root(top.path()) {
        return;
    }
    chmod(top.path(), 0o711);
    let dir = top.path().join("n");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
    chmod(&dir, 0o700);
    let mut child = as_nobody(
        "child_node",
        &[("KVTIER_TRUST_DIR", dir.display().to_string())],
    );
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("TRUST:serving") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child node did not start"
        );
    }
    let sock = dir.join("node.sock");
    // The hostile-listener case of issue 26: root's engine on nobody's socket.
    let e = NodeStore::connect(&sock, "m", NodeClientOptions::default()).unwrap_err();
    assert!(e.to_string().contains("uid 65534"), "{e}");
    // Named by node_uid, that node is accepted; its arena arrives as a descriptor of its uid.
    let opts = NodeClientOptions {
        node_uids: vec![NOBODY],
        ..NodeClientOptions::default()
    };
    let s = NodeStore::connect(&sock, "m", opts).unwrap();
    s.put(SequenceHash(1), &block(1)).unwrap();
    let mut out = vec![0u8; BLOCK];
    s.get(SequenceHash(1), &mut out).unwrap();
    assert_eq!(out, block(1));
    drop(s);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

/// A node of 8 blocks in `dir` (made private) that lets `nobody` attach.
fn nobody_allowed(dir: &std::path::Path) -> NodeOptions {
    chmod(dir, 0o700);
    let mut o = NodeOptions::new(dir.join("node.sock"), 8 * BLOCK as u64);
    o.shm_dir = dir.to_path_buf();
    o.allowed_uids = vec![NOBODY];
    o
}

#[test]
fn allowed_tenants_attach_in_namespaces_of_their_own_and_others_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    if !root(dir.path()) {
        return;
    }
    let o = nobody_allowed(dir.path());
    let n = NodeServer::start(&o).unwrap();
    let mine = NodeStore::connect(n.socket(), "m", NodeClientOptions::default()).unwrap();
    mine.put(SequenceHash(2), &block(2)).unwrap();
    let vars = [
        ("KVTIER_TRUST_SOCK", n.socket().display().to_string()),
        ("KVTIER_TRUST_NODE_UID", "0".to_string()),
    ];
    let lines = trust_lines(as_nobody("child_client", &vars));
    // nobody cannot see root's block through the node, nor read it in memory: its arena is
    // its own (planted: every uid passed the node's own arena: reads-2=true).
    assert_eq!(
        lines,
        vec![
            "attached",
            "put=true",
            "sees-2=false",
            "arenas-mapped=1",
            "reads-2=false"
        ],
        "{lines:?}"
    );
    // nobody's `m` is not root's `m`, both ways.
    assert_eq!(
        mine.contains(&[SequenceHash(1), SequenceHash(2)]).unwrap(),
        vec![false, true]
    );
    assert_eq!(n.stats().blocks, 2);
    drop(n);

    // Without --allow-uid: even with the socket opened up by hand, SO_PEERCRED refuses nobody.
    let d2 = tempfile::tempdir().unwrap();
    chmod(d2.path(), 0o711);
    let mut o2 = NodeOptions::new(d2.path().join("node.sock"), 8 * BLOCK as u64);
    o2.shm_dir = d2.path().to_path_buf();
    let n2 = NodeServer::start(&o2).unwrap();
    chmod(n2.socket(), 0o666);
    let vars = [
        ("KVTIER_TRUST_SOCK", n2.socket().display().to_string()),
        ("KVTIER_TRUST_NODE_UID", "0".to_string()),
    ];
    let lines = trust_lines(as_nobody("child_client", &vars));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("refused"), "{lines:?}");
    // The node itself is fine.
    let mut s = UnixStream::connect(n2.socket()).unwrap();
    s.write_all(&[0]).unwrap();
}

/// A tenant holds the arena's descriptor read-write; truncating it would make the node's next
/// touch of it (a checksum at commit, a spill to disk) fault and kill the node for every
/// tenant. The node seals every other uid's arena against it.
#[test]
fn a_tenant_cannot_truncate_its_arena_under_the_node() {
    let dir = tempfile::tempdir().unwrap();
    if !root(dir.path()) {
        return;
    }
    let mut o = nobody_allowed(dir.path());
    o.disk_dir = Some(dir.path().join("disk"));
    o.disk_bytes = 1 << 20;
    let mut n = NodeServer::start(&o).unwrap();
    let vars = [("KVTIER_TRUST_SOCK", n.socket().display().to_string())];
    let lines = trust_lines(as_nobody("child_truncator", &vars));
    assert_eq!(lines, vec!["put=true", "truncated=false"], "{lines:?}");
    // The node still reads that arena: the shutdown spills nobody's block to disk.
    let mine = NodeStore::connect(n.socket(), "m", NodeClientOptions::default()).unwrap();
    mine.put(SequenceHash(2), &block(2)).unwrap();
    drop(mine);
    n.shutdown(Duration::from_secs(2));
    assert_eq!(n.stats().disk_blocks, 2, "both tenants' blocks spilled");
}

/// The connection cap is per uid: a tenant that holds as many connections as it may locks out
/// neither the node's own uid nor anyone else.
#[test]
fn one_tenants_connections_do_not_lock_out_another_uid() {
    let dir = tempfile::tempdir().unwrap();
    if !root(dir.path()) {
        return;
    }
    let mut o = nobody_allowed(dir.path());
    o.max_connections = 3;
    let n = NodeServer::start(&o).unwrap();
    let vars = [
        ("KVTIER_TRUST_SOCK", n.socket().display().to_string()),
        ("KVTIER_TRUST_CONNS", "3".to_string()),
    ];
    let mut child = as_nobody("child_hog", &vars);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("TRUST:holding") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the hog did not attach"
        );
    }
    assert!(line.contains("holding=3 one-more=false"), "{line}");
    // Root's engine attaches while nobody holds its whole quota.
    let mine = NodeStore::connect(n.socket(), "m", NodeClientOptions::default()).unwrap();
    mine.put(SequenceHash(2), &block(2)).unwrap();
    assert_eq!(mine.contains(&[SequenceHash(2)]).unwrap(), vec![true]);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}
