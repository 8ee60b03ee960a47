//! Warm restart and reclaim of the disk tier (#13, #14 item 1): a store re-opened on the same
//! directory serves the blocks an earlier process made durable, byte-exact and bound to their
//! keys, after a clean exit or a SIGKILL; torn, truncated, deleted or foreign files and a torn
//! journal tail are dropped, never served; a dead or failed process's files are taken over;
//! two live stores never share files.
#![allow(clippy::unwrap_used)]
mod common;

use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::pattern;
use kvtier::hash::SequenceHash;
use kvtier::ids::BlockId;
use kvtier_io::storage::disk::{recoverable_blocks, FLUSH_AGE};
use kvtier_io::*;

const BPB: usize = 2 * 4096;
const SLOTS: u32 = 16;
const PER_FILE: u32 = 4;
const SLOT_BYTES: u64 = 4096 + BPB as u64;

fn key(b: u32) -> u128 {
    0x5eed_0000_0000_0000_0000_0000_0000_0000u128 | (b as u128) << 32 | 7
}

fn opts(dir: &Path, persist: bool) -> DiskOptions {
    let mut o = DiskOptions::new(dir, SLOTS, BPB);
    o.blocks_per_file = PER_FILE;
    o.name = "kv".into();
    o.persist = persist;
    o
}

/// Write slots `0..n` (slot b = pattern(b) under key(b)).
fn fill(d: &DiskStorage, slots: std::ops::Range<u32>) {
    for b in slots {
        d.write_block_keyed(b, key(b), &pattern(b, BPB)).unwrap();
    }
}

/// Every recovered block reads back byte-exact under its key; returns the recovered slots.
fn check_recovered(d: &DiskStorage) -> Vec<u32> {
    let mut slots = Vec::new();
    let mut buf = vec![0u8; BPB];
    for &(h, b) in d.recovered() {
        assert_eq!(
            h,
            SequenceHash(key(b.0)),
            "slot {} recovered under another key",
            b.0
        );
        d.read_block_keyed(b.0, h.0, &mut buf).unwrap();
        assert_eq!(buf, pattern(b.0, BPB), "slot {} differs", b.0);
        slots.push(b.0);
    }
    slots.sort_unstable();
    slots
}

/// Slots whose load fails (keyed), among `0..SLOTS`; loads that succeed are checked exact.
fn failing(d: &DiskStorage) -> Vec<u32> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; BPB];
    for b in 0..SLOTS {
        match d.read_block_keyed(b, key(b), &mut buf) {
            Ok(()) => assert_eq!(buf, pattern(b, BPB), "slot {b} served other bytes"),
            Err(_) => out.push(b),
        }
    }
    out
}

fn data_file(d: &DiskStorage, slot: u32) -> (PathBuf, u64) {
    let (f, off) = d.slot_position(slot).unwrap();
    (d.file_paths()[f].clone(), off)
}

fn filled_then_closed(dir: &Path) -> DiskStorage {
    let d = DiskStorage::create(&opts(dir, true)).unwrap();
    fill(&d, 0..SLOTS);
    d
}

#[test]
fn clean_restart_serves_every_block() {
    let tmp = tempfile::tempdir().unwrap();
    drop(filled_then_closed(tmp.path()));
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(d.set_name(), "kv");
    assert_eq!(check_recovered(&d), (0..SLOTS).collect::<Vec<_>>());
    // New writes get newer generations than the recovered ones and survive the next restart.
    d.write_block_keyed(3, key(3), &pattern(3, BPB)).unwrap();
    drop(d);
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(check_recovered(&d).len(), SLOTS as usize);
}

#[test]
fn truncated_data_file_drops_the_cut_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let d = filled_then_closed(tmp.path());
    let (path, off) = data_file(&d, 6);
    drop(d);
    // Cut slot 6 in the middle of its payload: slots 6 and 7 (same file) are gone.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(off + 4096 + 100).unwrap();
    drop(f);
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    let want: Vec<u32> = (0..SLOTS).filter(|s| ![6, 7].contains(s)).collect();
    assert_eq!(check_recovered(&d), want);
    assert_eq!(failing(&d), vec![6, 7]);
}

#[test]
fn torn_journal_tail_drops_only_its_records() {
    let tmp = tempfile::tempdir().unwrap();
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    fill(&d, 0..8);
    d.sync().unwrap();
    fill(&d, 8..9);
    let ix = d.index_path().unwrap();
    drop(d);
    // The last record (slot 8) is cut in half, as a power cut mid-append would leave it.
    let len = std::fs::metadata(&ix).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ix)
        .unwrap()
        .set_len(len - 30)
        .unwrap();
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(check_recovered(&d), (0..8).collect::<Vec<_>>());
    // Slot 8's data is intact on disk but no durable record names it: not served.
    assert!(failing(&d).contains(&8));
    // Garbage appended to the journal (a torn record) is dropped too.
    drop(d);
    let mut f = std::fs::OpenOptions::new().append(true).open(&ix).unwrap();
    f.write_all(&[0x77; 64 + 17]).unwrap();
    drop(f);
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(check_recovered(&d), (0..8).collect::<Vec<_>>());
}

#[test]
fn torn_or_rewritten_block_is_recovered_but_never_served() {
    let tmp = tempfile::tempdir().unwrap();
    let d = filled_then_closed(tmp.path());
    let (path, off) = data_file(&d, 5);
    drop(d);
    // Half a newer payload over slot 5 (a write torn by a crash after its record).
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(off + 4096 + BPB as u64 / 2))
        .unwrap();
    f.write_all(&pattern(999, BPB / 2)).unwrap();
    drop(f);
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    // The journal cannot know (it is not re-read block by block); the load verifies and fails.
    assert_eq!(d.recovered().len(), SLOTS as usize);
    let mut buf = vec![0u8; BPB];
    let e = d.read_block_keyed(5, key(5), &mut buf).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    assert_eq!(failing(&d), vec![5]);
}

#[test]
fn deleted_or_foreign_data_files_are_not_served() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let d = filled_then_closed(tmp.path());
    let (file0, _) = data_file(&d, 0);
    let (file1, _) = data_file(&d, 4);
    drop(d);
    // Another set (same geometry, same keys and contents!) whose file replaces file 0.
    let o = filled_then_closed(other.path());
    let (foreign0, _) = data_file(&o, 0);
    drop(o);
    std::fs::copy(&foreign0, &file0).unwrap();
    std::fs::remove_file(&file1).unwrap();
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    // File 1's slots are dropped at open; file 0's are listed but fail as foreign.
    let rec: Vec<u32> = d.recovered().iter().map(|r| r.1 .0).collect();
    assert!(!rec.iter().any(|s| (4..8).contains(s)), "{rec:?}");
    let mut buf = vec![0u8; BPB];
    let e = d.read_block_keyed(0, key(0), &mut buf).unwrap_err();
    assert!(e.to_string().contains("foreign"), "{e}");
    assert_eq!(failing(&d), (0..8).collect::<Vec<_>>());
}

#[test]
fn other_geometry_or_persist_off_starts_cold() {
    let tmp = tempfile::tempdir().unwrap();
    drop(filled_then_closed(tmp.path()));
    let mut o = opts(tmp.path(), true);
    o.block_bytes = BPB + 4096;
    let d = DiskStorage::create(&o).unwrap();
    assert!(d.recovered().is_empty());
    drop(d);
    drop(filled_then_closed(tmp.path()));
    let d = DiskStorage::create(&opts(tmp.path(), false)).unwrap();
    assert!(d.recovered().is_empty());
    assert_eq!(failing(&d), (0..SLOTS).collect::<Vec<_>>());
    let sub = d.dir().to_path_buf();
    drop(d);
    // Without persist nothing but the empty lock file stays.
    let left: Vec<String> = std::fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, vec!["kv.lock".to_string()]);
}

#[test]
fn two_live_stores_get_separate_file_sets() {
    let tmp = tempfile::tempdir().unwrap();
    let a = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    let b = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!((a.set_name(), b.set_name()), ("kv", "kv.1"));
    a.write_block_keyed(0, key(0), &pattern(0, BPB)).unwrap();
    b.write_block_keyed(0, key(1), &pattern(1, BPB)).unwrap();
    let mut buf = vec![0u8; BPB];
    a.read_block_keyed(0, key(0), &mut buf).unwrap();
    assert_eq!(buf, pattern(0, BPB));
    b.read_block_keyed(0, key(1), &mut buf).unwrap();
    assert_eq!(buf, pattern(1, BPB));
    drop(a);
    // The freed set "kv" is the one the next store takes (and serves again).
    let c = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(c.set_name(), "kv");
    assert_eq!(c.recovered(), &[(SequenceHash(key(0)), BlockId(0))]);
}

/// Regression (#13): a start that fails part-way (here: the second data file's path is taken
/// by a directory) left its preallocated files behind. Now it removes them, and the next start
/// gets the set.
#[test]
fn failed_start_leaves_no_files() {
    let tmp = tempfile::tempdir().unwrap();
    let sub = tmp.path().join(SUBDIR);
    std::fs::create_dir(&sub).unwrap();
    let blocker = sub.join("kv-00002.kvblk");
    std::fs::create_dir(&blocker).unwrap();
    let e = DiskStorage::create(&opts(tmp.path(), true)).unwrap_err();
    assert!(e.to_string().contains("kv-00002"), "{e}");
    let mut left: Vec<String> = std::fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(
        left,
        vec!["kv-00002.kvblk", "kv.lock"],
        "only the blocker and the lock"
    );
    std::fs::remove_dir(&blocker).unwrap();
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(d.set_name(), "kv");
}

const CHILD_DIR: &str = "KVTIER_DISK_CHILD_DIR";
const CHILD_PERSIST: &str = "KVTIER_DISK_CHILD_PERSIST";

/// Not a test by itself: the child process of the SIGKILL tests (run with `--ignored`). It
/// fills slots 0..12 and calls `sync`, writes 12..16 and leaves them to the flusher thread
/// (waiting 10 x `FLUSH_AGE`), says READY and waits to be killed.
#[test]
#[ignore = "child process of the sigkill tests"]
fn child_fill_and_wait_for_sigkill() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let persist = std::env::var(CHILD_PERSIST)
        .map(|v| v == "1")
        .unwrap_or(false);
    let d = DiskStorage::create(&opts(Path::new(&dir), persist)).unwrap();
    fill(&d, 0..12);
    d.sync().unwrap();
    fill(&d, 12..SLOTS);
    std::thread::sleep(FLUSH_AGE * 10);
    println!("READY {}", d.set_name());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(120));
}

/// The child process, SIGKILLed when dropped (also when a test fails first).
struct Child(std::process::Child);

impl Child {
    fn sigkill(&mut self) {
        self.0.kill().unwrap(); // SIGKILL on Unix
        self.0.wait().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start the child on `dir` and wait until it has written its blocks.
fn child(dir: &Path, persist: bool) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_fill_and_wait_for_sigkill",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir)
        .env(CHILD_PERSIST, if persist { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            // libtest may print "test <name> ... " in front of the child's own output.
            Some(Ok(l)) if l.contains("READY ") => {
                assert!(l.ends_with("READY kv"), "{l}");
                break;
            }
            Some(Ok(_)) => continue,
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                panic!("child exited before it was ready");
            }
        }
    }
    Child(c)
}

fn dir_bytes(sub: &Path) -> u64 {
    std::fs::read_dir(sub)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// #14 item 1: a process fills G3 and is killed with SIGKILL; a new store on the same directory
/// serves the blocks that were durable, byte-exact, and takes the dead process's files over.
#[test]
fn sigkilled_process_blocks_are_served_by_the_next_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = child(tmp.path(), true);
    // While the child lives, its set is locked: a second store gets its own files.
    let other = DiskStorage::create(&opts(tmp.path(), false)).unwrap();
    assert_eq!(other.set_name(), "kv.1");
    assert!(other.recovered().is_empty());
    drop(other);
    c.sigkill();
    let d = DiskStorage::create(&opts(tmp.path(), true)).unwrap();
    assert_eq!(d.set_name(), "kv", "the dead process's set is taken over");
    // 0..12 by `sync`, 12..16 by the flusher of a quiet store: all durable before READY.
    assert_eq!(check_recovered(&d), (0..SLOTS).collect::<Vec<_>>());
    assert!(failing(&d).is_empty());
}

/// Regression (#13): cache files of a SIGKILLed process (named by its PID) were never
/// reclaimed. Now the next store of the name takes the same files over: the directory holds
/// one set's worth of bytes, not two.
#[test]
fn sigkilled_process_files_are_reclaimed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = child(tmp.path(), false);
    c.sigkill();
    let sub = tmp.path().join(SUBDIR);
    let after_kill = dir_bytes(&sub);
    assert_eq!(
        after_kill,
        SLOTS as u64 * SLOT_BYTES,
        "the dead child's files"
    );
    let d = DiskStorage::create(&opts(tmp.path(), false)).unwrap();
    assert_eq!(d.set_name(), "kv");
    assert_eq!(dir_bytes(&sub), after_kill, "files reused, not duplicated");
    assert_eq!(
        failing(&d),
        (0..SLOTS).collect::<Vec<_>>(),
        "cold: nothing served"
    );
    drop(d);
    assert_eq!(dir_bytes(&sub), 0, "only the empty lock file is left");
}

/// A leader apart from its workers learns what a warm restart serves from the journals alone:
/// the (key, slot) pairs every rank's set holds alike.
#[test]
fn recoverable_blocks_are_those_every_rank_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let rank = |r: u32| {
        let mut o = opts(tmp.path(), true);
        o.name = format!("rank{r}");
        DiskStorage::create(&o).unwrap()
    };
    let (r0, r1) = (rank(0), rank(1));
    fill(&r0, 0..6);
    fill(&r1, 0..4);
    r1.write_block_keyed(5, key(99), &pattern(5, BPB)).unwrap();
    r0.sync().unwrap();
    r1.sync().unwrap();
    let sets = [("rank0", BPB), ("rank1", BPB)];
    let want: Vec<(SequenceHash, BlockId)> =
        (0..4).map(|b| (SequenceHash(key(b)), BlockId(b))).collect();
    // Read while the stores are live (no lock needed) and after they are gone.
    assert_eq!(recoverable_blocks(tmp.path(), SLOTS, PER_FILE, &sets), want);
    drop((r0, r1));
    assert_eq!(recoverable_blocks(tmp.path(), SLOTS, PER_FILE, &sets), want);
    // Another geometry, a missing set or a bad name: nothing.
    assert!(recoverable_blocks(tmp.path(), SLOTS, PER_FILE, &[("rank0", BPB * 2)]).is_empty());
    assert!(recoverable_blocks(tmp.path(), SLOTS, PER_FILE, &[("rank7", BPB)]).is_empty());
    assert!(recoverable_blocks(tmp.path(), SLOTS, PER_FILE, &[("../x", BPB)]).is_empty());
}
