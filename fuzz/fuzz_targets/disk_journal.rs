//! The disk tier's journal replay (what a warm restart reads from `<set>.idx`, a file anyone with
//! write access to `disk.dir` could have changed) on journals built from the input: records with
//! valid checksums (slots in and out of range, zero and repeated generations), then optionally a
//! flipped byte anywhere (superblock or records) and a cut tail. Never panics; the table never
//! holds a record that was not written, nor a slot out of range, nor two entries for one slot;
//! for an undamaged journal it is exactly the model's: records apply in order until the first
//! invalid one, and the highest generation per slot wins (the first of equal ones).
#![no_main]
use kvtier_io::storage::disk::fuzz::{journal, replay, JournalRecord, NUM_BLOCKS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let records: Vec<JournalRecord> = rest
        .chunks_exact(7)
        .map(|c| {
            (
                u32::from(c[0] % 80),
                u64::from(u16::from_le_bytes([c[1], c[2]])),
                u128::from(u16::from_le_bytes([c[3], c[4]])),
                u64::from(u16::from_le_bytes([c[5], c[6]])),
            )
        })
        .collect();
    let mut bytes = journal(0x5eed, &records);
    let damaged = mode & 3 != 0;
    if mode & 1 != 0 {
        let at = (usize::from(mode) * 2654435761) % bytes.len();
        bytes[at] ^= 1 << (mode % 8);
    }
    if mode & 2 != 0 {
        let cut = usize::from(mode >> 2) % bytes.len().max(1);
        bytes.truncate(bytes.len() - cut);
    }
    let Some(table) = replay(&bytes) else {
        assert!(damaged, "an undamaged journal was not replayed");
        return;
    };
    let mut slots: Vec<u32> = table.iter().map(|r| r.0).collect();
    slots.dedup();
    assert_eq!(slots.len(), table.len(), "two entries for one slot");
    for r in &table {
        assert!(r.0 < NUM_BLOCKS && r.1 != 0, "{r:?}");
        assert!(records.contains(r), "replay invented {r:?}");
    }
    if !damaged {
        let mut model: Vec<Option<JournalRecord>> = vec![None; NUM_BLOCKS as usize];
        for r in &records {
            if r.0 >= NUM_BLOCKS || r.1 == 0 {
                break;
            }
            let cur = &mut model[r.0 as usize];
            if cur.is_none_or(|c| r.1 > c.1) {
                *cur = Some(*r);
            }
        }
        let model: Vec<JournalRecord> = model.into_iter().flatten().collect();
        assert_eq!(table, model);
    }
});
