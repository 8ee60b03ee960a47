//! Fault injection on the disk tier: a flipped byte, a truncated file, a deleted file, a stale
//! or torn slot, ENOSPC and EIO each fail exactly the blocks concerned, never return wrong
//! bytes as data, and leave every other block intact.
#![allow(clippy::unwrap_used)]
mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use common::{job, pattern};
use kvtier::transfer::{BlockTransfer, TransferOutcome};
use kvtier::Tier;
use kvtier_io::*;

const BPB: usize = 3 * 4096;

struct Rig {
    _tmp: tempfile::TempDir,
    host: Arc<HostStorage>,
    disk: Arc<DiskStorage>,
    engine: TransferEngine,
    faults: Arc<FaultInjector>,
}

fn rig(blocks: u32, io: DiskIoMode) -> Rig {
    let tmp = tempfile::tempdir().unwrap();
    let mut ho = HostOptions::new(blocks, BPB);
    ho.pin = PinMode::Never;
    let host = Arc::new(HostStorage::new(&ho).unwrap());
    let faults = Arc::new(FaultInjector::new());
    let mut o = DiskOptions::new(tmp.path().join("kv"), blocks, BPB);
    o.blocks_per_file = 4;
    o.io = io;
    o.faults = Some(faults.clone());
    let disk = Arc::new(DiskStorage::create(&o).unwrap());
    let engine = TransferEngine::builder()
        .host(host.clone())
        .disk(disk.clone())
        .build()
        .unwrap();
    Rig {
        _tmp: tmp,
        host,
        disk,
        engine,
        faults,
    }
}

impl Rig {
    fn run(&self, src: Tier, dst: Tier, pairs: &[(u32, u32)]) -> TransferOutcome {
        let f = self.engine.fence(None).unwrap();
        self.engine.execute(&job(src, dst, pairs), &f)
    }
    /// Fill host blocks with patterns and store host block b in disk slot b.
    fn store_all(&self, n: u32) {
        for b in 0..n {
            self.host.write_block(b, &pattern(b, BPB)).unwrap();
        }
        let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, b)).collect();
        assert_eq!(
            self.run(Tier::Host, Tier::Disk, &pairs),
            TransferOutcome::Ok
        );
        for b in 0..n {
            self.host.write_block(b, &vec![0; BPB]).unwrap();
        }
    }
    /// Load every slot back into host block of the same number; returns failed pair indices
    /// and checks that every successful block is bit-exact.
    fn load_all(&self, n: u32) -> Vec<usize> {
        let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, b)).collect();
        let out = self.run(Tier::Disk, Tier::Host, &pairs);
        let failed = out.failed_pairs();
        let mut buf = vec![0u8; BPB];
        for b in 0..n {
            if !failed.contains(&(b as usize)) {
                self.host.read_block(b, &mut buf).unwrap();
                assert_eq!(buf, pattern(b, BPB), "block {b} reported ok but differs");
            }
        }
        failed
    }
    fn file_of(&self, slot: u32) -> (std::path::PathBuf, u64) {
        let (f, off) = self.disk.slot_position(slot).unwrap();
        (self.disk.file_paths()[f].clone(), off)
    }
}

fn reason(out: &TransferOutcome, pair: usize) -> String {
    match out {
        TransferOutcome::Failed(f) => f
            .iter()
            .find(|b| b.pair_index == pair)
            .unwrap()
            .reason
            .clone(),
        TransferOutcome::Ok => panic!("expected a failure"),
    }
}

#[test]
fn flipped_byte_on_disk_fails_that_block_only() {
    for io in [DiskIoMode::Uring, DiskIoMode::Sync] {
        let r = rig(8, io);
        r.store_all(8);
        let (path, off) = r.file_of(5);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let at = off + 4096 + 777;
        let mut b = [0u8; 1];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[b[0] ^ 0x10]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        assert_eq!(r.load_all(8), vec![5]);
        let out = r.run(Tier::Disk, Tier::Host, &[(5, 5)]);
        assert!(reason(&out, 0).contains("checksum"), "{out:?}");
    }
}

#[test]
fn corrupted_header_fails_that_block_only() {
    let r = rig(6, DiskIoMode::Auto);
    r.store_all(6);
    let (path, off) = r.file_of(2);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(off + 13)).unwrap();
    f.write_all(&[0xFF]).unwrap();
    drop(f);
    assert_eq!(r.load_all(6), vec![2]);
}

#[test]
fn truncated_file_fails_the_cut_blocks() {
    let r = rig(8, DiskIoMode::Auto);
    r.store_all(8);
    // Slots 4..8 live in the second file; cut it in the middle of slot 6.
    let (path, off) = r.file_of(6);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(off + 4096 + 100).unwrap();
    drop(f);
    assert_eq!(r.load_all(8), vec![6, 7]);
}

/// A deleted file fails the blocks it held; it is recreated empty (#28: it was never
/// recreated, and the disk tier stayed dead for the rest of the process), so later writes and
/// reads of its slots work again, and the other files keep working throughout.
#[test]
fn deleted_file_fails_its_blocks_and_is_recreated() {
    let r = rig(8, DiskIoMode::Auto);
    r.store_all(8);
    let (path, _) = r.file_of(0);
    std::fs::remove_file(&path).unwrap();
    let out = r.run(Tier::Disk, Tier::Host, &[(0, 0), (5, 5)]);
    assert_eq!(out.failed_pairs(), vec![0]);
    assert!(reason(&out, 0).contains("deleted"));
    assert!(path.exists(), "the deleted file was not recreated");
    // Its other blocks are gone (the new file is empty), the other file's are not.
    assert_eq!(r.load_all(8), vec![0, 1, 2, 3]);
    // Writes to it work again, and read back.
    r.host.write_block(1, &pattern(1, BPB)).unwrap();
    r.host.write_block(5, &pattern(5, BPB)).unwrap();
    assert_eq!(
        r.run(Tier::Host, Tier::Disk, &[(1, 1), (5, 5)]),
        TransferOutcome::Ok
    );
    assert_eq!(r.load_all(8), vec![0, 2, 3]);
}

#[test]
fn stale_slot_contents_are_rejected() {
    let r = rig(4, DiskIoMode::Auto);
    r.store_all(4);
    let (path, off) = r.file_of(1);
    let mut old = vec![0u8; 4096 + BPB];
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    f.seek(SeekFrom::Start(off)).unwrap();
    f.read_exact(&mut old).unwrap();
    // Rewrite slot 1 with other data, then put the old bytes back (a lost write).
    r.host.write_block(0, &pattern(99, BPB)).unwrap();
    assert!(r.run(Tier::Host, Tier::Disk, &[(0, 1)]).is_ok());
    f.seek(SeekFrom::Start(off)).unwrap();
    f.write_all(&old).unwrap();
    drop(f);
    let out = r.run(Tier::Disk, Tier::Host, &[(1, 1)]);
    assert!(reason(&out, 0).contains("stale"), "{out:?}");
}

#[test]
fn torn_write_is_rejected() {
    let r = rig(4, DiskIoMode::Auto);
    r.store_all(4);
    // Half of a newer payload lands over the old one, header unchanged.
    let (path, off) = r.file_of(3);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(off + 4096 + BPB as u64 / 2))
        .unwrap();
    f.write_all(&pattern(1234, BPB / 2)).unwrap();
    drop(f);
    assert_eq!(r.load_all(4), vec![3]);
}

#[test]
fn enospc_and_eio_fail_only_their_blocks() {
    for io in [DiskIoMode::Uring, DiskIoMode::Sync] {
        let r = rig(8, io);
        r.store_all(8);
        // The disk fills up while slot 2 is rewritten: slot 2 is lost (not readable as old
        // data), the others stay.
        r.faults
            .add(FaultOp::Write, 2..3, Fault::Errno(libc::ENOSPC), Some(1));
        r.host.write_block(0, &pattern(2, BPB)).unwrap();
        let out = r.run(Tier::Host, Tier::Disk, &[(0, 2), (0, 3)]);
        assert_eq!(out.failed_pairs(), vec![0]);
        assert!(reason(&out, 0).contains("No space left"), "{out:?}");
        // slot 3 now holds pattern(2); put pattern(3) back for the bit-exact check.
        r.host.write_block(3, &pattern(3, BPB)).unwrap();
        assert!(r.run(Tier::Host, Tier::Disk, &[(3, 3)]).is_ok());
        r.faults
            .add(FaultOp::Read, 6..7, Fault::Errno(libc::EIO), Some(1));
        assert_eq!(r.load_all(8), vec![2, 6]);
        // EIO was transient: slot 6 reads fine again.
        assert_eq!(r.load_all(8), vec![2]);
    }
}

#[test]
fn injected_short_io_and_silent_flip_fail_their_blocks() {
    let r = rig(8, DiskIoMode::Auto);
    r.store_all(8);
    r.faults
        .add(FaultOp::Read, 1..2, Fault::Short(5000), Some(1));
    r.faults
        .add(FaultOp::Read, 4..5, Fault::FlipByte(BPB - 1), Some(1));
    assert_eq!(r.load_all(8), vec![1, 4]);
    r.faults
        .add(FaultOp::Write, 7..8, Fault::Short(4096 + 10), Some(1));
    r.host.write_block(0, &pattern(7, BPB)).unwrap();
    assert_eq!(
        r.run(Tier::Host, Tier::Disk, &[(0, 7)]).failed_pairs(),
        vec![0]
    );
    assert_eq!(r.load_all(8), vec![7]);
}

#[test]
fn never_written_slot_is_an_error() {
    let r = rig(4, DiskIoMode::Auto);
    let out = r.run(Tier::Disk, Tier::Host, &[(0, 0), (9, 1)]);
    assert_eq!(out.failed_pairs(), vec![0, 1]);
    assert!(reason(&out, 0).contains("no valid data"));
}

#[test]
fn directory_and_files_are_private() {
    let r = rig(4, DiskIoMode::Auto);
    let dir_mode = std::fs::metadata(r.disk.dir())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dir_mode, 0o700);
    for p in r.disk.file_paths() {
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    let paths = r.disk.file_paths();
    drop(r.engine);
    drop(r.disk);
    assert!(
        paths.iter().all(|p| !p.exists()),
        "cache files are removed with the tier"
    );
}

/// A real full file system: a 1 MiB tmpfs (needs root and mount; skipped otherwise). The tier
/// cannot preallocate and says so, instead of failing later.
#[test]
fn full_file_system_is_a_setup_error() {
    let tmp = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(tmp.path())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("cannot mount a tmpfs here: skipping");
        return;
    }
    let o = DiskOptions::new(tmp.path().join("kv"), 64, 64 * 1024);
    let r = DiskStorage::create(&o);
    let _ = std::process::Command::new("umount")
        .arg(tmp.path())
        .status();
    let e = r.unwrap_err();
    assert!(e.to_string().contains("disk full"), "{e}");
}

fn keyed_job(
    src: Tier,
    dst: Tier,
    pairs: &[(u32, u32)],
    keys: &[u128],
) -> kvtier::transfer::TransferJob {
    // Pair `i`'s disk block is bound to `keys[i]`.
    let disk = |i: usize, slot: u32| kvtier::transfer::DiskBlock {
        slot: kvtier::BlockId(slot),
        key: kvtier::hash::SequenceHash(keys[i]),
    };
    let id = kvtier::JobId(1);
    let pairs = pairs.iter().enumerate();
    match (src, dst) {
        (Tier::Host, Tier::Disk) => kvtier::transfer::TransferJob::from_pairs(
            id,
            pairs.map(|(i, &(s, d))| (kvtier::BlockId(s), disk(i, d))),
        ),
        (Tier::Disk, Tier::Host) => kvtier::transfer::TransferJob::from_pairs(
            id,
            pairs.map(|(i, &(s, d))| (disk(i, s), kvtier::BlockId(d))),
        ),
        _ => panic!("keyed jobs are host <-> disk"),
    }
}

fn key(b: u32) -> u128 {
    0xabcd_0000_0000_0000_0000_0000_0000_0000u128 | b as u128
}

impl Rig {
    fn store_keyed(&self, n: u32) {
        for b in 0..n {
            self.host.write_block(b, &pattern(b, BPB)).unwrap();
        }
        let pairs: Vec<(u32, u32)> = (0..n).map(|b| (b, b)).collect();
        let keys: Vec<u128> = (0..n).map(key).collect();
        let f = self.engine.fence(None).unwrap();
        let out = self
            .engine
            .execute(&keyed_job(Tier::Host, Tier::Disk, &pairs, &keys), &f);
        assert_eq!(out, TransferOutcome::Ok);
    }
    fn load_keyed(&self, slot: u32, k: u128) -> TransferOutcome {
        self.host.write_block(slot, &vec![0; BPB]).unwrap();
        let f = self.engine.fence(None).unwrap();
        self.engine.execute(
            &keyed_job(Tier::Disk, Tier::Host, &[(slot, slot)], &[k]),
            &f,
        )
    }
    fn slot_bytes(&self, slot: u32) -> Vec<u8> {
        let (path, off) = self.file_of(slot);
        let mut f = std::fs::File::open(path).unwrap();
        let mut b = vec![0u8; 4096 + BPB];
        f.seek(SeekFrom::Start(off)).unwrap();
        f.read_exact(&mut b).unwrap();
        b
    }
    fn put_slot_bytes(&self, slot: u32, b: &[u8]) {
        let (path, off) = self.file_of(slot);
        let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(b).unwrap();
    }
}

/// Regression (#13, key binding): a load that names another key than the one the slot was
/// written under is refused (a stale or confused leader mapping never serves foreign bytes).
#[test]
fn load_under_another_key_is_refused() {
    let r = rig(4, DiskIoMode::Auto);
    r.store_keyed(4);
    let out = r.load_keyed(2, key(2));
    assert!(out.is_ok(), "{out:?}");
    let mut buf = vec![0u8; BPB];
    r.host.read_block(2, &mut buf).unwrap();
    assert_eq!(buf, pattern(2, BPB));
    let out = r.load_keyed(2, key(3));
    assert!(reason(&out, 0).contains("not the requested"), "{out:?}");
}

/// Regression (#13, key binding): one block's bytes copied over another's slot are refused,
/// and so is a header whose key field was patched and re-sealed with a valid checksum.
#[test]
fn block_copied_over_another_slot_or_rekeyed_is_refused() {
    let r = rig(4, DiskIoMode::Auto);
    r.store_keyed(4);
    // Slot 1's header and payload copied over slot 2.
    let one = r.slot_bytes(1);
    r.put_slot_bytes(2, &one);
    let out = r.load_keyed(2, key(2));
    assert!(!out.is_ok(), "copied block served: {out:?}");
    let out = r.load_keyed(2, 0);
    assert!(!out.is_ok(), "copied block served unkeyed: {out:?}");
    // Slot 3's header re-keyed to key(1) and re-sealed: its checksum is valid, its key is not.
    let mut three = r.slot_bytes(3);
    let k = HEADER_KEY_OFFSET;
    three[k..k + 16].copy_from_slice(&key(1).to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&three[..64]);
    three[64..72].copy_from_slice(&sum.to_le_bytes());
    r.put_slot_bytes(3, &three);
    let out = r.load_keyed(3, key(3));
    assert!(reason(&out, 0).contains("another block"), "{out:?}");
    // Slot 0 untouched.
    assert!(r.load_keyed(0, key(0)).is_ok());
}

/// Fault matrix: a cache file replaced under the running store (another file renamed over its
/// path, even one with the very same bytes) fails its blocks; the other files keep serving.
#[test]
fn replaced_file_fails_its_blocks() {
    let r = rig(8, DiskIoMode::Auto);
    r.store_keyed(8);
    let (path, _) = r.file_of(4);
    let copy = path.with_extension("copy");
    std::fs::copy(&path, &copy).unwrap();
    std::fs::rename(&copy, &path).unwrap();
    for s in 0..8 {
        let out = r.load_keyed(s, key(s));
        if s < 4 {
            assert!(out.is_ok(), "slot {s}: {out:?}");
        } else if s == 4 {
            assert!(reason(&out, 0).contains("deleted"), "slot {s}: {out:?}");
        } else {
            // The file was recreated empty: its blocks fail their checks.
            assert!(!out.is_ok(), "slot {s}: {out:?}");
        }
    }
}
