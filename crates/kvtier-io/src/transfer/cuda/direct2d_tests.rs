//! CPU checks of the direct layered load's plan: the steps replayed on bytes standing for host
//! and device memory (each 2D copy row by row, as the copy engine walks it) must have written
//! every byte of layer `l` of every block when `LayerDone(l)` comes, each layer must be done
//! exactly once, and in the end device memory must be exactly what a plain per-chunk copy of
//! every block makes of it (nothing written outside the job's chunks).
#![allow(clippy::unwrap_used)]

use super::*;

const LAYERS: usize = 4;
const CHUNK: usize = 64; // one layer's K (or V) of one block
const BPB: usize = LAYERS * 2 * CHUNK;
const HOST: usize = 0x1000;
const DEV_BLOCKS: usize = 32;
const DEV: usize = HOST + 64 * BPB;
const MEM: usize = DEV + 2 * LAYERS * DEV_BLOCKS * CHUNK;

type Items = Vec<(usize, Vec<Chunk>, usize)>;

/// The engine's chunks of device block `d` in vLLM's per-layer layout: layer `l`'s K at
/// `DEV + (2l) * DEV_BLOCKS * CHUNK + d * CHUNK`, its V in the next plane.
fn chunks(d: usize) -> Vec<Chunk> {
    (0..2 * LAYERS)
        .map(|p| Chunk {
            addr: (DEV + (p * DEV_BLOCKS + d) * CHUNK) as u64,
            len: CHUNK,
        })
        .collect()
}

/// Pair `i` loads host slot `slots[i]` into device block `devs[i]`.
fn items(slots: &[usize], devs: &[usize]) -> Items {
    assert_eq!(slots.len(), devs.len());
    (0..slots.len())
        .map(|i| (i, chunks(devs[i]), HOST + slots[i] * BPB))
        .collect()
}

/// Memory before the load: host blocks hold bytes below 251, everything else 0xFF (so a byte
/// left unwritten never passes for a copied one).
fn initial(items: &Items, bpb: usize, size: usize) -> Vec<u8> {
    let mut mem = vec![0xFFu8; size];
    for (i, _, host) in items {
        for b in 0..bpb {
            mem[host + b] = ((i * 31 + b * 7) % 251) as u8;
        }
    }
    mem
}

/// Whether canonical bytes `[from, to)` of every block are on the device.
fn layer_in(mem: &[u8], items: &Items, from: usize, to: usize) -> bool {
    items.iter().all(|(_, chunks, host)| {
        let mut off = 0;
        chunks.iter().all(|c| {
            let (a, b) = (off.max(from), (off + c.len).min(to));
            let ok = a >= b || {
                let d = c.addr as usize + (a - off);
                mem[d..d + (b - a)] == mem[host + a..host + b]
            };
            off += c.len;
            ok
        })
    })
}

/// Replay `steps` on bytes; `Err` names the first layer done before its bytes, done twice or
/// never, or a final state unlike a plain per-chunk copy's.
fn replay_sized(
    steps: &[Step],
    items: &Items,
    bpb: usize,
    layers: usize,
    size: usize,
) -> Result<(), String> {
    let mut mem = initial(items, bpb, size);
    let mut want = mem.clone();
    for (_, chunks, host) in items {
        let mut off = 0;
        for c in chunks {
            let bytes = want[host + off..host + off + c.len].to_vec();
            want[c.addr as usize..c.addr as usize + c.len].copy_from_slice(&bytes);
            off += c.len;
        }
    }
    let s = bpb / layers;
    let mut done = vec![false; layers];
    for (k, step) in steps.iter().enumerate() {
        match *step {
            Step::Copy(c) => {
                for r in 0..c.height {
                    let (from, to) = (c.src as usize + r * c.spitch, c.dst as usize + r * c.dpitch);
                    let outside = || format!("step {k}, row {r} outside memory");
                    let bytes = mem.get(from..from + c.width).ok_or_else(outside)?.to_vec();
                    let dst = mem.get_mut(to..to + c.width).ok_or_else(outside)?;
                    dst.copy_from_slice(&bytes);
                }
            }
            Step::LayerDone(l) => {
                if done[l] {
                    return Err(format!("layer {l} done twice (step {k})"));
                }
                if !layer_in(&mem, items, l * s, (l + 1) * s) {
                    return Err(format!("layer {l} done at step {k} before its bytes"));
                }
                done[l] = true;
            }
        }
    }
    if let Some(l) = done.iter().position(|d| !d) {
        return Err(format!("layer {l} never done"));
    }
    if mem != want {
        let at = mem.iter().zip(&want).position(|(a, b)| a != b).unwrap();
        return Err(format!("byte {at:#x} differs from a per-chunk copy's"));
    }
    Ok(())
}

fn replay(plan: &Direct2dPlan, items: &Items) -> Result<(), String> {
    replay_sized(&plan.steps, items, BPB, LAYERS, MEM)
}

fn copies(plan: &Direct2dPlan) -> Vec<Copy2d> {
    let c = plan.steps.iter().filter_map(|s| match s {
        Step::Copy(c) => Some(*c),
        Step::LayerDone(_) => None,
    });
    c.collect()
}

#[test]
fn consecutive_slots_and_ids_make_one_copy_per_plane_and_layer() {
    let n = 9;
    let slots: Vec<usize> = (0..n).collect();
    let devs: Vec<usize> = (3..3 + n).collect();
    let items = items(&slots, &devs);
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    replay(&plan, &items).unwrap();
    assert_eq!(plan.copies, 2 * LAYERS);
    // Per layer: the K run, the V run, then the layer's event.
    for (l, w) in plan.steps.chunks(3).enumerate() {
        assert_eq!(w[2], Step::LayerDone(l));
        for (p, s) in w[..2].iter().enumerate() {
            let want = Copy2d {
                src: (HOST + (2 * l + p) * CHUNK) as u64,
                spitch: BPB,
                dst: chunks(3)[2 * l + p].addr,
                dpitch: CHUNK,
                width: CHUNK,
                height: n,
            };
            assert_eq!(*s, Step::Copy(want), "layer {l} plane {p}");
        }
    }
    assert!(plan.within_bound(LAYERS));
}

#[test]
fn a_32k_job_of_consecutive_blocks_is_64_copies() {
    // 2048 blocks x 32 layers x (K, V), as Llama-3.1-8B's 32K prompt, with 16-byte chunks so the
    // replay stays small: one 2D copy per plane per layer.
    let (blocks, layers, chunk) = (2048usize, 32usize, 16usize);
    let bpb = layers * 2 * chunk;
    let dev = HOST + blocks * bpb;
    let items: Items = (0..blocks)
        .map(|b| {
            let chunks = (0..2 * layers)
                .map(|p| Chunk {
                    addr: (dev + (p * blocks + b) * chunk) as u64,
                    len: chunk,
                })
                .collect();
            (b, chunks, HOST + b * bpb)
        })
        .collect();
    let plan = direct2d_plan(&items, bpb, layers).unwrap();
    assert_eq!(plan.copies, 64);
    assert!(plan.within_bound(layers));
    let size = dev + 2 * layers * blocks * chunk;
    replay_sized(&plan.steps, &items, bpb, layers, size).unwrap();
    // The same job with device ids running against the host slots: one copy per piece, over
    // the bound (the kernel mode takes it).
    let mut opposite = items.clone();
    for (b, it) in opposite.iter_mut().enumerate() {
        it.1 = items[blocks - 1 - b].1.clone();
    }
    let plan = direct2d_plan(&opposite, bpb, layers).unwrap();
    assert_eq!(plan.copies, blocks * 2 * layers);
    assert!(!plan.within_bound(layers));
}

#[test]
fn scattered_ids_fall_into_short_runs_and_stay_exact() {
    // Host slots (5 i + 3) % 11 (3, 8, 2, 7, 1, 6, 0), device blocks 15 - 2 i: slots step +5, -6,
    // +5, ... and blocks -2, so only the pairs stepping (-6, -2) join, as backward runs of 2.
    let slots: Vec<usize> = (0..7).map(|i| (5 * i + 3) % 11).collect();
    let devs: Vec<usize> = (0..7).map(|i| 15 - 2 * i).collect();
    let items = items(&slots, &devs);
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    replay(&plan, &items).unwrap();
    assert_eq!(plan.copies, 4 * 2 * LAYERS);
    let heights: Vec<usize> = copies(&plan)[..4].iter().map(|c| c.height).collect();
    assert_eq!(heights, vec![1, 2, 2, 2]);
}

#[test]
fn reversed_jobs_run_backwards_and_opposite_strides_do_not_join() {
    // Both descending with the pair (the job listed last block first): runs emitted forward.
    let slots: Vec<usize> = (0..8).rev().collect();
    let devs: Vec<usize> = (10..18).rev().collect();
    let items_rev = items(&slots, &devs);
    let plan = direct2d_plan(&items_rev, BPB, LAYERS).unwrap();
    replay(&plan, &items_rev).unwrap();
    assert_eq!(plan.copies, 2 * LAYERS);
    let first = copies(&plan)[0];
    assert_eq!((first.src, first.height), (HOST as u64, 8));
    assert_eq!(first.dst, chunks(10)[0].addr);
    // Host slots up, device blocks down (the GPU test's load): a pitch cannot be negative.
    let devs: Vec<usize> = (10..18).rev().collect();
    let items_opp = items(&(0..8).collect::<Vec<_>>(), &devs);
    let plan = direct2d_plan(&items_opp, BPB, LAYERS).unwrap();
    replay(&plan, &items_opp).unwrap();
    assert_eq!(plan.copies, 8 * 2 * LAYERS);
}

#[test]
fn mixed_runs_are_cut_where_a_stride_changes() {
    // A run of 4 (stride 1, 1), one of 3 at stride (2, 2), then a lone block.
    let slots = [0, 1, 2, 3, 7, 9, 11, 12];
    let devs = [10, 11, 12, 13, 2, 4, 6, 20];
    let items = items(&slots, &devs);
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    replay(&plan, &items).unwrap();
    let c = copies(&plan);
    assert_eq!(plan.copies, 3 * 2 * LAYERS);
    let heights: Vec<usize> = c[..6].iter().map(|c| c.height).collect();
    assert_eq!(
        heights,
        vec![4, 3, 1, 4, 3, 1],
        "layer 0: K runs, then V runs"
    );
    assert_eq!((c[1].spitch, c[1].dpitch), (2 * BPB, 2 * CHUNK));
    // Only one side's stride changes: the source's, then the device's.
    for (slots, devs) in [([0, 1, 2, 4], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1, 2, 5])] {
        let items = self::items(&slots, &devs);
        let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
        replay(&plan, &items).unwrap();
        let heights: Vec<usize> = copies(&plan)[..2].iter().map(|c| c.height).collect();
        assert_eq!(heights, vec![3, 1], "{slots:?} -> {devs:?}");
    }
    // A run whose rows would overlap (device ids equal) is never joined: width > pitch.
    let items = self::items(&[0, 1], &[5, 5]);
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    assert_eq!(plan.copies, 2 * 2 * LAYERS);
}

#[test]
fn chunks_spanning_layers_are_cut_at_the_layer_boundaries() {
    // Each block's chunks 1..=6 coalesced into one contiguous device range crossing layers 0-3.
    let mut items = items(&[0, 1, 2, 3], &[0, 1, 2, 3]);
    for it in &mut items {
        let d = it.1.clone();
        let base = (DEV + 2 * LAYERS * DEV_BLOCKS * CHUNK + it.0 * BPB) as u64;
        it.1 = vec![
            d[0],
            Chunk {
                addr: base,
                len: 6 * CHUNK,
            },
            d[7],
        ];
    }
    let size = DEV + 2 * LAYERS * DEV_BLOCKS * CHUNK + 4 * BPB;
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    replay_sized(&plan.steps, &items, BPB, LAYERS, size).unwrap();
    // Layer 0: the K plane run, then the merged chunk's first piece (its blocks BPB apart).
    let c = copies(&plan);
    assert_eq!((c[0].width, c[0].height), (CHUNK, 4));
    assert_eq!((c[1].width, c[1].dpitch, c[1].height), (CHUNK, BPB, 4));
}

#[test]
fn blocks_that_do_not_split_into_equal_layers_are_not_planned() {
    let items = items(&[0, 2], &[0, 1]);
    assert!(direct2d_plan(&items, BPB, 3).is_none(), "uneven layers");
    assert!(direct2d_plan(&items, BPB, 0).is_none(), "no layers");
    assert!(
        direct2d_plan(&items, BPB, BPB + 1).is_none(),
        "more layers than bytes"
    );
    let mut short = items.clone();
    short[1].1.pop();
    assert!(
        direct2d_plan(&short, BPB, LAYERS).is_none(),
        "chunks short of a block"
    );
    assert!(
        direct2d_plan(&items, BPB + 8, LAYERS).is_none(),
        "chunks past a block's size"
    );
    // Odd addresses are fine for copies (no kernel's wide loads).
    let mut odd = items;
    odd[0].2 += 3;
    let plan = direct2d_plan(&odd, BPB, LAYERS).unwrap();
    replay(&plan, &odd).unwrap();
}

#[test]
fn a_plan_with_an_early_event_or_a_wrong_pitch_fails_the_replay() {
    // The check guarding the plan must fail a plan whose layer 0 is done before its V run...
    let items = items(&[0, 1, 2, 3, 4], &[6, 7, 8, 9, 10]);
    let plan = direct2d_plan(&items, BPB, LAYERS).unwrap();
    let mut early = plan.steps.clone();
    early.swap(1, 2);
    let e = replay_sized(&early, &items, BPB, LAYERS, MEM).unwrap_err();
    assert!(e.contains("layer 0"), "{e}");
    // ... one whose device pitch is off ...
    let mut bent = plan.steps.clone();
    if let Step::Copy(c) = &mut bent[4] {
        c.dpitch += 16;
    }
    assert!(replay_sized(&bent, &items, BPB, LAYERS, MEM).is_err());
    // ... and one that never records a layer.
    let mut lost = plan.steps;
    lost.pop();
    let e = replay_sized(&lost, &items, BPB, LAYERS, MEM).unwrap_err();
    assert!(e.contains("never"), "{e}");
}

#[test]
fn lane_runs_respect_the_pitch_limit() {
    let far = MAX_PITCH as u64 + 1;
    let rows = [(0, 0, 16), (far, 16, 16), (2 * far, 32, 16)];
    assert_eq!(lane_runs(&rows).len(), 3, "a source pitch over the limit");
    let rows = [(0, 0, 16), (32, 16, 16), (64, 32, 16)];
    let r = lane_runs(&rows);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].spitch, r[0].dpitch, r[0].height), (32, 16, 3));
    assert!(lane_runs(&[]).is_empty());
}
