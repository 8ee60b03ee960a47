//! CPU checks of the staged layered load's plan: the rounds replayed on bytes in order (copies,
//! then the scatter, then the layer events) must have written every byte of layer `l` of every
//! block when `l`'s event is recorded, and everything by the end.
#![allow(clippy::unwrap_used)]

use super::*;

const LAYERS: usize = 4;
const CHUNK: usize = 64; // one layer's K (or V) of one block
const BPB: usize = LAYERS * 2 * CHUNK;
const NB: usize = 7; // blocks loaded
const HOST: u64 = 0x1000;
const STAGE: u64 = 0x4000;
const DEV: u64 = 0x8000;
const DEV_BLOCKS: usize = 16;

/// The engine's chunks of device block `d` in vLLM's per-layer layout: layer `l`'s K at
/// `DEV + (2l) * DEV_BLOCKS * CHUNK + d * CHUNK`, its V in the next plane.
fn chunks(d: usize) -> Vec<Chunk> {
    (0..2 * LAYERS)
        .map(|p| Chunk {
            addr: DEV + ((p * DEV_BLOCKS + d) * CHUNK) as u64,
            len: CHUNK,
        })
        .collect()
}

/// Loaded pair `i`: host slot `(5 i + 3) % 11` (not in order), device block `15 - 2 i`.
fn items() -> Vec<(usize, Vec<Chunk>, usize)> {
    (0..NB)
        .map(|i| {
            (
                i,
                chunks(DEV_BLOCKS - 1 - 2 * i),
                (HOST as usize) + ((5 * i + 3) % 11) * BPB,
            )
        })
        .collect()
}

fn mem_with_host_bytes(items: &[(usize, Vec<Chunk>, usize)]) -> Vec<u8> {
    let mut mem = vec![0u8; 0x10000];
    for (i, _, host) in items {
        for b in 0..BPB {
            mem[host + b] = (i * 31 + b * 7 + 1) as u8;
        }
    }
    mem
}

/// Layer `l` of pair `i` as the engine sees it.
fn device_layer(mem: &[u8], item: &(usize, Vec<Chunk>, usize), l: usize) -> Vec<u8> {
    item.1[2 * l..2 * l + 2]
        .iter()
        .flat_map(|c| mem[c.addr as usize..c.addr as usize + c.len].to_vec())
        .collect()
}

fn host_layer(mem: &[u8], item: &(usize, Vec<Chunk>, usize), l: usize) -> Vec<u8> {
    let at = item.2 + l * 2 * CHUNK;
    mem[at..at + 2 * CHUNK].to_vec()
}

/// Replay `rounds` on bytes; `Err` names the first layer whose event came before its bytes.
fn replay(rounds: &[StagedRound], items: &[(usize, Vec<Chunk>, usize)]) -> Result<(), String> {
    replay_with(rounds, items, false)
}

/// As [`replay`], each round's copies moved as [`runs_2d`] (row by row, as the copy engine
/// moves a 2D copy) when `two_d`.
fn replay_with(
    rounds: &[StagedRound],
    items: &[(usize, Vec<Chunk>, usize)],
    two_d: bool,
) -> Result<(), String> {
    let mut mem = mem_with_host_bytes(items);
    let mut ended = [false; LAYERS];
    for (r, round) in rounds.iter().enumerate() {
        let rows: Vec<(usize, usize, usize)> = if two_d {
            runs_2d(&round.copies)
                .iter()
                .flat_map(|r| {
                    (0..r.height).map(move |i| {
                        let s = r.src as usize + i * r.spitch;
                        (s, r.dst as usize + i * r.width, r.width)
                    })
                })
                .collect()
        } else {
            let c = round.copies.iter();
            c.map(|c| (c.src as usize, c.dst as usize, c.len)).collect()
        };
        for (s, d, n) in rows {
            let bytes = mem[s..s + n].to_vec();
            mem[d..d + n].copy_from_slice(&bytes);
        }
        for d in round.descs.chunks(3) {
            let (s, t, n) = (d[0] as usize, d[1] as usize, d[2] as usize);
            let bytes = mem[s..s + n].to_vec();
            mem[t..t + n].copy_from_slice(&bytes);
        }
        for l in round.ends.clone().unwrap_or(0..0) {
            for it in items {
                if device_layer(&mem, it, l) != host_layer(&mem, it, l) {
                    return Err(format!(
                        "layer {l} of pair {} ended at round {r} unwritten",
                        it.0
                    ));
                }
            }
            ended[l] = true;
        }
    }
    if let Some(l) = ended.iter().position(|e| !e) {
        return Err(format!("layer {l} never ended"));
    }
    Ok(())
}

#[test]
fn groups_take_the_smallest_divisor_reaching_the_slice_floor() {
    // Llama-3.1-8B on vLLM: 32 layers of 64 KiB, 16 MiB halves: 8 layers (512 KiB slices).
    assert_eq!(group_layers(32, 64 << 10, 512 << 10, 16 << 20), Some(8));
    // A half too small for 8 layers: the largest group that fits.
    assert_eq!(group_layers(32, 64 << 10, 512 << 10, 256 << 10), Some(4));
    // No divisor reaches the floor: every layer in one group (the whole block).
    assert_eq!(group_layers(3, 100, 1000, 1000), Some(3));
    // Not even one layer fits a half; no layers.
    assert_eq!(group_layers(4, 2000, 10, 1000), None);
    assert_eq!(group_layers(0, 64, 10, 1000), None);
}

#[test]
fn every_layer_is_written_before_its_event_and_halves_alternate() {
    let items = items();
    let slice = 2 * (BPB / LAYERS);
    let half = 3 * slice;
    let g = group_layers(LAYERS, BPB / LAYERS, slice, half).unwrap();
    assert_eq!(g, 2);
    let rounds = staged_rounds(&items, BPB, LAYERS, g, half, [STAGE, STAGE + half as u64]).unwrap();
    // 2 groups of 7 blocks, 3 blocks per round: 3 rounds each.
    assert_eq!(rounds.len(), 6);
    let ends: Vec<_> = rounds.iter().map(|r| r.ends.clone()).collect();
    assert_eq!(ends, vec![None, None, Some(0..2), None, None, Some(2..4)]);
    for (r, round) in rounds.iter().enumerate() {
        let lo = STAGE + ((r % 2) * half) as u64;
        for c in &round.copies {
            assert!(
                c.dst >= lo && c.dst + c.len as u64 <= lo + half as u64,
                "round {r} left its half"
            );
        }
    }
    replay(&rounds, &items).unwrap();
}

#[test]
fn a_layer_event_a_round_early_is_caught_by_the_replay() {
    // The check guarding the plan must fail a plan that ends group 0 before its last round.
    let items = items();
    let slice = 2 * (BPB / LAYERS);
    let half = 3 * slice;
    let mut rounds =
        staged_rounds(&items, BPB, LAYERS, 2, half, [STAGE, STAGE + half as u64]).unwrap();
    rounds[1].ends = rounds[2].ends.take();
    assert!(replay(&rounds, &items).unwrap_err().contains("layer 0"));
    // And one whose scatter skips a descriptor.
    let mut rounds =
        staged_rounds(&items, BPB, LAYERS, 2, half, [STAGE, STAGE + half as u64]).unwrap();
    let n = rounds[4].descs.len();
    rounds[4].descs.truncate(n - 3);
    assert!(replay(&rounds, &items).is_err());
}

#[test]
fn one_group_of_all_layers_is_a_whole_block_load() {
    let items = items();
    let half = 2 * BPB;
    let rounds = staged_rounds(
        &items,
        BPB,
        LAYERS,
        LAYERS,
        half,
        [STAGE, STAGE + half as u64],
    )
    .unwrap();
    assert_eq!(rounds.len(), NB.div_ceil(2));
    assert_eq!(rounds.last().unwrap().ends, Some(0..LAYERS));
    replay(&rounds, &items).unwrap();
}

#[test]
fn chunks_spanning_a_group_boundary_are_split_there() {
    // Block chunks coalesced across layers (one chunk per 3 layers' K/V pairs at the end).
    let mut items = items();
    for it in &mut items {
        let d = it.1.clone();
        // Merge chunks 1..=6 into pieces that cross the group boundary at 256 bytes: the
        // addresses are not contiguous on the device, so model it with a fresh contiguous run.
        let base = DEV + (DEV_BLOCKS * 2 * LAYERS * CHUNK) as u64 + (it.0 * BPB) as u64;
        it.1 = vec![
            d[0],
            Chunk {
                addr: base,
                len: 6 * CHUNK,
            },
            d[7],
        ];
    }
    let slice = 2 * (BPB / LAYERS);
    let half = 3 * slice;
    let rounds = staged_rounds(&items, BPB, LAYERS, 2, half, [STAGE, STAGE + half as u64]).unwrap();
    // The merged chunk's pieces: 3 * CHUNK in group 0 (after d[0]) and 3 * CHUNK in group 1.
    let lens: Vec<u64> = rounds[0].descs.chunks(3).map(|d| d[2]).collect();
    assert_eq!(&lens[..2], &[CHUNK as u64, 3 * CHUNK as u64]);
    let mut mem = mem_with_host_bytes(&items);
    for round in &rounds {
        for c in &round.copies {
            let bytes = mem[c.src as usize..c.src as usize + c.len].to_vec();
            mem[c.dst as usize..c.dst as usize + c.len].copy_from_slice(&bytes);
        }
        for d in round.descs.chunks(3) {
            let bytes = mem[d[0] as usize..(d[0] + d[2]) as usize].to_vec();
            mem[d[1] as usize..(d[1] + d[2]) as usize].copy_from_slice(&bytes);
        }
    }
    for it in &items {
        let got: Vec<u8> =
            it.1.iter()
                .flat_map(|c| mem[c.addr as usize..c.addr as usize + c.len].to_vec())
                .collect();
        assert_eq!(got, mem[it.2..it.2 + BPB].to_vec(), "pair {}", it.0);
    }
}

#[test]
fn unaligned_or_uneven_blocks_are_not_staged() {
    let items = items();
    let h = [STAGE, STAGE + 4096];
    assert!(
        staged_rounds(&items, BPB, 3, 1, 4096, h).is_none(),
        "uneven layers"
    );
    assert!(
        staged_rounds(&items, BPB, LAYERS, 3, 4096, h).is_none(),
        "group not a divisor"
    );
    assert!(
        staged_rounds(&items, BPB, LAYERS, 1, 64, h).is_none(),
        "slice over a half"
    );
    let mut odd = items.clone();
    odd[2].2 += 8;
    assert!(
        staged_rounds(&odd, BPB, LAYERS, 2, 4096, h).is_none(),
        "unaligned host block"
    );
    let mut short = items;
    short[0].1.pop();
    assert!(
        staged_rounds(&short, BPB, LAYERS, 2, 4096, h).is_none(),
        "chunks short of a block"
    );
}

#[test]
fn runs_2d_join_rows_at_one_stride_into_contiguous_bytes_only() {
    let c = |src: u64, dst: u64, len: usize| Copy { src, dst, len };
    let run = |src: u64, dst: u64, width: usize, spitch: usize, height: usize| Run2d {
        src,
        dst,
        width,
        spitch,
        height,
    };
    // Slices of consecutive host blocks (stride 100) into contiguous staging: one run.
    let rows = [c(10, 0, 20), c(110, 20, 20), c(210, 40, 20), c(310, 60, 20)];
    assert_eq!(runs_2d(&rows), vec![run(10, 0, 20, 100, 4)]);
    // Another stride, a gap in the staging bytes, another width, or rows that would overlap
    // start a new run.
    let rows = [c(10, 0, 20), c(110, 20, 20), c(250, 40, 20), c(350, 60, 20)];
    assert_eq!(
        runs_2d(&rows),
        vec![run(10, 0, 20, 100, 2), run(250, 40, 20, 100, 2)]
    );
    let rows = [c(10, 0, 20), c(110, 24, 20)];
    assert_eq!(
        runs_2d(&rows),
        vec![run(10, 0, 20, 20, 1), run(110, 24, 20, 20, 1)]
    );
    let rows = [c(10, 0, 20), c(110, 20, 16)];
    assert_eq!(
        runs_2d(&rows),
        vec![run(10, 0, 20, 20, 1), run(110, 20, 16, 16, 1)]
    );
    let rows = [c(10, 0, 20), c(20, 20, 20)];
    assert_eq!(runs_2d(&rows).len(), 2, "a stride shorter than a row");
    let rows = [c(110, 0, 20), c(10, 20, 20)];
    assert_eq!(runs_2d(&rows).len(), 2, "a row behind the last");
    assert!(runs_2d(&[]).is_empty());
}

#[test]
fn a_staged_load_moved_in_2d_runs_writes_what_its_copies_write() {
    // Host slots out of order (few runs), rising with gaps (runs cut where the stride
    // changes) and in order (one run per round).
    let at = |slots: [usize; NB]| -> Vec<(usize, Vec<Chunk>, usize)> {
        (0..NB)
            .map(|i| {
                (
                    i,
                    chunks(DEV_BLOCKS - 1 - 2 * i),
                    HOST as usize + slots[i] * BPB,
                )
            })
            .collect()
    };
    let cases = [
        (items(), false),
        (at([0, 1, 3, 4, 5, 8, 10]), false),
        (at([0, 1, 2, 3, 4, 5, 6]), true),
    ];
    for (items, ordered) in cases {
        for g in [1, 2, 4] {
            let slice = g * (BPB / LAYERS);
            let half = 3 * slice;
            let halves = [STAGE, STAGE + half as u64];
            let rounds = staged_rounds(&items, BPB, LAYERS, g, half, halves).unwrap();
            replay_with(&rounds, &items, true).unwrap();
            if ordered {
                for r in &rounds {
                    assert_eq!(runs_2d(&r.copies).len(), 1, "g {g}: {:?}", r.copies);
                }
            }
        }
    }
}
