//! Property test: random sequences of writes, reads, on-disk corruption and injected write
//! failures against a reference model of what each disk slot must return. A read either returns
//! exactly the last successfully written bytes or fails; it never returns other bytes.
#![allow(clippy::unwrap_used)]
mod common;

use std::io::{Seek, SeekFrom, Write};
use std::sync::Arc;

use common::{job, pattern};
use kvtier::transfer::BlockTransfer;
use kvtier::Tier;
use kvtier_io::*;
use proptest::prelude::*;

const SLOTS: u32 = 6;
const BPB: usize = 2 * 4096;

#[derive(Clone, Debug)]
enum Op {
    Write { slot: u32, seed: u32 },
    Read { slot: u32 },
    Corrupt { slot: u32, at: usize },
    FailNextWrite { slot: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SLOTS, any::<u32>()).prop_map(|(slot, seed)| Op::Write { slot, seed }),
        4 => (0..SLOTS).prop_map(|slot| Op::Read { slot }),
        1 => (0..SLOTS, 0..BPB + 56).prop_map(|(slot, at)| Op::Corrupt { slot, at }),
        1 => (0..SLOTS).prop_map(|slot| Op::FailNextWrite { slot }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn disk_tier_matches_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let tmp = tempfile::tempdir().unwrap();
        let mut ho = HostOptions::new(2, BPB);
        ho.pin = PinMode::Never;
        let host = Arc::new(HostStorage::new(&ho).unwrap());
        let faults = Arc::new(FaultInjector::new());
        let mut o = DiskOptions::new(tmp.path(), SLOTS, BPB);
        o.blocks_per_file = 4;
        o.faults = Some(faults.clone());
        let disk = Arc::new(DiskStorage::create(&o).unwrap());
        let e = TransferEngine::builder().host(host.clone()).disk(disk.clone()).build().unwrap();
        let mut model: Vec<Option<u32>> = vec![None; SLOTS as usize];
        let mut fail_pending = vec![false; SLOTS as usize];
        let fence = e.fence(None).unwrap();
        for op in ops {
            match op {
                Op::Write { slot, seed } => {
                    host.write_block(0, &pattern(seed, BPB)).unwrap();
                    let ok = e.execute(&job(Tier::Host, Tier::Disk, &[(0, slot)]), &fence).is_ok();
                    let expect_fail = std::mem::take(&mut fail_pending[slot as usize]);
                    prop_assert_eq!(ok, !expect_fail);
                    model[slot as usize] = if ok { Some(seed) } else { None };
                }
                Op::Read { slot } => {
                    host.write_block(1, &vec![0xEE; BPB]).unwrap();
                    let ok = e.execute(&job(Tier::Disk, Tier::Host, &[(slot, 1)]), &fence).is_ok();
                    match model[slot as usize] {
                        Some(seed) => {
                            prop_assert!(ok, "slot {} should read back", slot);
                            let mut out = vec![0u8; BPB];
                            host.read_block(1, &mut out).unwrap();
                            prop_assert!(out == pattern(seed, BPB), "slot {} returned other bytes", slot);
                        }
                        None => prop_assert!(!ok, "slot {} has no valid data but read succeeded", slot),
                    }
                }
                Op::Corrupt { slot, at } => {
                    let (f, off) = disk.slot_position(slot).unwrap();
                    let path = &disk.file_paths()[f];
                    let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
                    // `at` < BPB + 56: the header's 56 checked bytes or the payload (the rest of
                    // the header page is padding that carries no data).
                    let pos = if at < 56 { off + at as u64 } else { off + 4096 + (at - 56) as u64 };
                    file.seek(SeekFrom::Start(pos)).unwrap();
                    let written = model[slot as usize].is_some();
                    // Write a byte that surely differs from what is there: read it first.
                    let cur = {
                        use std::io::Read;
                        let mut r = std::fs::File::open(path).unwrap();
                        r.seek(SeekFrom::Start(pos)).unwrap();
                        let mut b = [0u8; 1];
                        r.read_exact(&mut b).unwrap();
                        b[0]
                    };
                    file.write_all(&[cur ^ 0x5A]).unwrap();
                    if written {
                        model[slot as usize] = None;
                    }
                }
                Op::FailNextWrite { slot } => {
                    if !fail_pending[slot as usize] {
                        faults.add(FaultOp::Write, slot..slot + 1, Fault::Errno(libc::ENOSPC), Some(1));
                        fail_pending[slot as usize] = true;
                    }
                }
            }
        }
    }
}
