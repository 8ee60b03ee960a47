//! Connector benchmarks: the leader's work per engine step, and matching a long prompt.
//!
//! - `leader_step/256_mixed`: one `build_step` for 256 running requests (about 15 of them in
//!   chunked prefill with 256-token chunks, i.e. ~3800 prefill tokens and ~240 newly full blocks
//!   per step; the rest decoding; finished requests are replaced by new 1024-token ones), plus
//!   applying the workers' reports for the step's stores and taking the step's KV events.
//!   `leader_step/256_decode`: the same with all 256 requests decoding. `*_hot`: the same, each
//!   step built just before it is timed (its records in cache, as an adapter's are) instead of
//!   read from 2,000 steps generated in advance. Baselines in the same run:
//!   `leader_step/slots_only_*`, the same records through bare slots (no pools, no jobs).
//! - `match/32k_prompt`: `get_num_new_matched_tokens` on a fresh 32768-token prompt whose 2048
//!   blocks are all in G2, hashing included. Baseline: `match/hash_only_32k`, hashing alone.
//!
//! `KVTIER_BENCH_IDS=vllm` uses vLLM-shaped request ids (39 bytes) instead of short ones.
//! `KVTIER_BENCH_HOST=<blocks>` changes the G2 size (default 50,000), e.g. to see how much of the
//! step is cache misses in the pool (a pool that fits in L2 against one that does not).
//!
//! Every figure comes twice: wall time, and (`*_oncpu`) the benchmark thread's on-CPU time from
//! `CLOCK_THREAD_CPUTIME_ID`, which stays meaningful on a shared, overloaded machine.
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used)]
use std::collections::HashMap;
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, Criterion};
use kvtier::connector::{
    ClusterLayout, Leader, LeaderConfig, SchedulerStep, Slot, StepRecord, WorkerReport,
};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::transfer::TransferOutcome;
use kvtier::{DeviceBlockId, RequestId};

const BS: usize = 16;
const SALT: HashSalt = HashSalt(5);
const RUNNING: usize = 256;
const PROMPT: usize = 1024;
const CHUNK: usize = 256;
const DECODE: usize = 64;
const DEV_BLOCKS: u32 = 1 << 20;
/// G2 blocks: 100 GB of host memory at 2 MiB per block (Llama-3.1-8B, 16 tokens).
const HOST_BLOCKS: usize = 50_000;

struct Req {
    id: RequestId,
    tokens: Vec<u32>,
    computed: usize,
    reported_tokens: usize,
    table: Vec<DeviceBlockId>,
    reported_blocks: usize,
    first: bool,
}

/// The bench's request ids: short (`req-N`, like TensorRT-LLM's integers), or with
/// `KVTIER_BENCH_IDS=vllm` shaped like vLLM's (`cmpl-` + 32 hex digits + `-0`, 39 bytes: too long
/// to live inline in a `RequestId`).
fn request_id(n: u64) -> RequestId {
    if std::env::var("KVTIER_BENCH_IDS").is_ok_and(|v| v == "vllm") {
        RequestId::from(format!(
            "cmpl-{:032x}-0",
            (n as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
        ))
    } else {
        RequestId::from(format!("req-{n}"))
    }
}

/// A steady stream of engine steps over `RUNNING` requests.
struct Workload {
    decode: usize,
    reqs: Vec<Req>,
    next_id: u64,
    next_block: u32,
}

impl Workload {
    /// `decode`: generated tokens per request; `all_decoding`: every request starts past its prompt.
    fn new(decode: usize, all_decoding: bool) -> Self {
        let mut w = Workload {
            decode,
            reqs: Vec::new(),
            next_id: 0,
            next_block: 0,
        };
        for i in 0..RUNNING {
            // Stagger: request i starts `i % (PROMPT/CHUNK + DECODE)` steps into its life.
            let mut r = w.fresh();
            let age = if all_decoding {
                PROMPT / CHUNK + 1 + i % DECODE
            } else {
                i % (PROMPT / CHUNK + DECODE)
            };
            r.computed = (age * CHUNK).min(PROMPT);
            if age > PROMPT / CHUNK {
                let extra = age - PROMPT / CHUNK;
                r.tokens.extend((0..extra).map(|t| t as u32));
                r.computed = r.tokens.len() - 1;
            }
            w.reqs.push(r);
        }
        w
    }

    fn fresh(&mut self) -> Req {
        self.next_id += 1;
        let seed = self.next_id as u32;
        Req {
            id: request_id(self.next_id),
            tokens: (0..PROMPT as u32)
                .map(|t| t.wrapping_mul(2_654_435_761) ^ seed)
                .collect(),
            computed: 0,
            reported_tokens: 0,
            table: Vec::new(),
            reported_blocks: 0,
            first: true,
        }
    }

    fn block(&mut self) -> DeviceBlockId {
        self.next_block = (self.next_block + 1) % DEV_BLOCKS;
        DeviceBlockId(self.next_block)
    }

    /// The next step's records (and the requests finished in it).
    fn step(&mut self) -> SchedulerStep {
        let mut records = Vec::with_capacity(RUNNING);
        let mut finished = Vec::new();
        for i in 0..self.reqs.len() {
            if self.reqs[i].tokens.len() >= PROMPT + self.decode {
                finished.push(self.reqs[i].id.clone());
                self.reqs[i] = self.fresh();
            }
            let (computed, len) = (self.reqs[i].computed, self.reqs[i].tokens.len());
            let scheduled = if computed + 1 < len {
                CHUNK.min(len - computed)
            } else {
                1
            };
            let need = (computed + scheduled).div_ceil(BS);
            while self.reqs[i].table.len() < need {
                let b = self.block();
                self.reqs[i].table.push(b);
            }
            let r = &mut self.reqs[i];
            records.push(StepRecord {
                request_id: r.id.clone(),
                new_tokens: r.tokens[r.reported_tokens..].to_vec(),
                new_block_ids: r.table[r.reported_blocks..].to_vec(),
                num_computed_tokens: computed,
                num_scheduled_tokens: scheduled,
                num_draft_tokens: 0,
                is_new: r.first,
                resumed_from_preemption: false,
            });
            r.reported_tokens = r.tokens.len();
            r.reported_blocks = r.table.len();
            r.first = false;
            r.computed += scheduled;
            if r.computed >= r.tokens.len() {
                let t = r.tokens.len() as u32;
                r.tokens.push(t);
                r.computed = r.tokens.len() - 1;
            }
        }
        SchedulerStep { records, finished }
    }
}

/// On-CPU time of the calling thread since an arbitrary origin (`CLOCK_THREAD_CPUTIME_ID`).
/// On a shared, overloaded machine wall time mostly measures the other processes; this does not.
fn thread_cpu() -> Duration {
    thread_local! {
        static ORIGIN: cpu_time::ThreadTime = cpu_time::ThreadTime::now();
    }
    ORIGIN.with(|o| o.elapsed())
}

fn leader() -> Leader {
    let host: usize = std::env::var("KVTIER_BENCH_HOST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(HOST_BLOCKS);
    let mut cfg = LeaderConfig::new(BS, SALT, host);
    cfg.layout = Some(ClusterLayout {
        block_size: BS as u32,
        num_device_blocks: DEV_BLOCKS,
        bytes_per_block: vec![2 << 20],
    });
    Leader::new(cfg).unwrap()
}

/// One engine step as the benchmark times it: `build_step`, a report for each store, the KV events.
fn run_step(l: &mut Leader, s: &SchedulerStep) -> usize {
    let m = l.build_step(s).unwrap();
    for st in &m.stores {
        l.apply_report(WorkerReport {
            rank: 0,
            job: st.job.id,
            outcome: TransferOutcome::Ok,
        });
    }
    // An engine pulls the KV events every step (vLLM's take_events).
    black_box(l.take_events().len());
    m.stores.len()
}

fn bench_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("leader_step");
    // 256_mixed: a quarter-ish in chunked prefill; 256_decode: everyone decoding (per-record cost).
    for (label, decode, all_decoding) in
        [("256_mixed", DECODE, false), ("256_decode", 1 << 30, true)]
    {
        step_group(&mut g, label, decode, all_decoding);
    }
    g.finish();
}

fn step_group(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    label: &str,
    decode: usize,
    all_decoding: bool,
) {
    // Pre-generate steps so the workload generator is not measured.
    let mut w = Workload::new(decode, all_decoding);
    let steps: Vec<SchedulerStep> = (0..2000).map(|_| w.step()).collect();

    fn warm(steps: &[SchedulerStep]) -> Leader {
        let mut l = leader();
        for s in steps {
            run_step(&mut l, s);
        }
        l
    }
    // Steady state: slots exist and the host pool cycles (the warm-up is not timed).
    const WARM: usize = 200;
    let mut l = warm(&steps[..WARM]);
    let mut i = WARM;
    // Each variant reports one clock: wall time, or this thread's on-CPU time.
    for cpu_clock in [false, true] {
        let name = if cpu_clock {
            format!("{label}_oncpu")
        } else {
            label.to_string()
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut wall = Duration::ZERO;
                let mut untimed = Duration::ZERO;
                let cpu0 = thread_cpu();
                for _ in 0..iters {
                    if i == steps.len() {
                        let c = thread_cpu();
                        l = warm(&steps[..WARM]);
                        i = WARM;
                        untimed += thread_cpu() - c;
                    }
                    let t = Instant::now();
                    black_box(run_step(&mut l, &steps[i]));
                    wall += t.elapsed();
                    i += 1;
                }
                if cpu_clock {
                    (thread_cpu() - cpu0).saturating_sub(untimed)
                } else {
                    wall
                }
            })
        });
    }

    // Hot inputs: each step is built just before it is timed, as an adapter builds its records
    // from the scheduler's output right before `build_step` (its records are then in cache).
    let warm_hot = || {
        let mut w = Workload::new(decode, all_decoding);
        let mut l = leader();
        for _ in 0..WARM {
            let s = w.step();
            run_step(&mut l, &s);
        }
        (w, l)
    };
    let (mut hot, mut hl) = warm_hot();
    let mut hot_steps = WARM;
    for cpu_clock in [false, true] {
        let name = if cpu_clock {
            format!("{label}_hot_oncpu")
        } else {
            format!("{label}_hot")
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut wall = Duration::ZERO;
                let mut cpu = Duration::ZERO;
                for _ in 0..iters {
                    // As the pre-generated variant, start over every 2000 steps (untimed): the
                    // all-decoding workload's requests never finish, and their tables and
                    // the device block ids would grow without end.
                    hot_steps += 1;
                    if hot_steps == 2000 {
                        (hot, hl) = warm_hot();
                        hot_steps = 0;
                    }
                    let s = hot.step();
                    let (t, c) = (Instant::now(), thread_cpu());
                    black_box(run_step(&mut hl, &s));
                    cpu += thread_cpu() - c;
                    wall += t.elapsed();
                }
                if cpu_clock {
                    cpu
                } else {
                    wall
                }
            })
        });
    }

    let mut slots: HashMap<RequestId, Slot> = HashMap::new();
    let mut out = Vec::new();
    let mut j = 0;
    for cpu_clock in [false, true] {
        let name = if cpu_clock {
            format!("slots_only_{label}_oncpu")
        } else {
            format!("slots_only_{label}")
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut wall = Duration::ZERO;
                let mut untimed = Duration::ZERO;
                let cpu0 = thread_cpu();
                for _ in 0..iters {
                    if j == steps.len() {
                        let c = thread_cpu();
                        slots.clear();
                        j = 0;
                        untimed += thread_cpu() - c;
                    }
                    let t = Instant::now();
                    let mut n = 0;
                    for r in &steps[j].records {
                        // As the leader does: one lookup, a key copy only for a new request.
                        out.clear();
                        if let Some(s) = slots.get_mut(&r.request_id) {
                            s.apply_into(r, &mut out).unwrap();
                        } else {
                            let mut s = Slot::new(r.request_id.clone(), BS, SALT);
                            s.apply_into(r, &mut out).unwrap();
                            slots.insert(r.request_id.clone(), s);
                        }
                        n += out.len();
                    }
                    for f in &steps[j].finished {
                        slots.remove(f);
                    }
                    wall += t.elapsed();
                    black_box(n);
                    j += 1;
                }
                if cpu_clock {
                    (thread_cpu() - cpu0).saturating_sub(untimed)
                } else {
                    wall
                }
            })
        });
    }
}

fn bench_match(c: &mut Criterion) {
    let mut g = c.benchmark_group("match");
    let prompt: Vec<u32> = (0..32_768u32)
        .map(|t| t.wrapping_mul(40_503) % 32_000)
        .collect();
    // Fill G2 with the prompt's 2048 blocks through the normal offload path.
    let mut l = leader();
    let id: RequestId = "fill".into();
    let blocks: Vec<DeviceBlockId> = (0..2048).map(DeviceBlockId).collect();
    l.update_state_after_alloc(&id, &blocks, Some(0)).unwrap();
    let step = SchedulerStep {
        records: vec![StepRecord {
            request_id: id.clone(),
            new_tokens: prompt.clone(),
            new_block_ids: blocks,
            num_computed_tokens: 0,
            num_scheduled_tokens: prompt.len(),
            is_new: true,
            ..Default::default()
        }],
        finished: vec![],
    };
    let m = l.build_step(&step).unwrap();
    for st in &m.stores {
        l.apply_report(WorkerReport {
            rank: 0,
            job: st.job.id,
            outcome: TransferOutcome::Ok,
        });
    }
    assert_eq!(l.stats().offload_confirmed, 2048);
    let probe: RequestId = "probe".into();
    assert_eq!(
        l.get_num_new_matched_tokens(&probe, &prompt, 0).unwrap(),
        32_768 - BS
    );
    let _ = l.request_finished(&probe).unwrap();

    for cpu_clock in [false, true] {
        let sfx = if cpu_clock { "_oncpu" } else { "" };
        g.bench_function(format!("32k_prompt{sfx}"), |b| {
            b.iter_custom(|iters| {
                let (t, c) = (Instant::now(), thread_cpu());
                for _ in 0..iters {
                    let n = l
                        .get_num_new_matched_tokens(&probe, black_box(&prompt), 0)
                        .unwrap();
                    let _ = l.request_finished(&probe).unwrap();
                    black_box(n);
                }
                if cpu_clock {
                    thread_cpu() - c
                } else {
                    t.elapsed()
                }
            })
        });
        g.bench_function(format!("hash_only_32k{sfx}"), |b| {
            b.iter_custom(|iters| {
                let (t, c) = (Instant::now(), thread_cpu());
                for _ in 0..iters {
                    black_box(sequence_hashes(SALT, black_box(&prompt), BS));
                }
                if cpu_clock {
                    thread_cpu() - c
                } else {
                    t.elapsed()
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_step, bench_match);

/// `KVTIER_PROFILE_STEPS=<n>`: run the warm-up and then exactly `n` steps of `256_mixed`
/// (`run_step`, no criterion), for instruction-level profilers such as
/// `valgrind --tool=callgrind --toggle-collect='*run_step*'`, whose counts are then comparable
/// between builds.
fn main() {
    if let Some(n) = std::env::var("KVTIER_PROFILE_STEPS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        // `KVTIER_PROFILE_HOT=1`: build each step just before running it (hot inputs).
        // `KVTIER_PROFILE_TIMING=1`: time every step (wall clock) and print percentiles, which
        // stay readable on a shared machine where means do not.
        let hot = std::env::var("KVTIER_PROFILE_HOT").is_ok_and(|v| v == "1");
        let timing = std::env::var("KVTIER_PROFILE_TIMING").is_ok_and(|v| v == "1");
        let mut w = Workload::new(DECODE, false);
        let mut l = leader();
        let mut stores = 0;
        let mut times = Vec::with_capacity(n);
        let mut timed = |l: &mut Leader, s: &SchedulerStep, i: usize| {
            let t = Instant::now();
            stores += run_step(l, s);
            if i >= 200 {
                times.push(t.elapsed());
            }
        };
        if hot {
            for i in 0..200 + n {
                let s = w.step();
                timed(&mut l, &s, i);
            }
        } else {
            let steps: Vec<SchedulerStep> = (0..200 + n).map(|_| w.step()).collect();
            for (i, s) in steps.iter().enumerate() {
                timed(&mut l, s, i);
            }
        }
        println!("{n} steps after 200 warm-up steps: {stores} store jobs in all");
        if timing {
            times.sort();
            let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
            println!(
                "per step (us): p10 {:.1}  p25 {:.1}  p50 {:.1}  p90 {:.1}  p99.9 {:.1}  max {:.1}",
                p(0.1),
                p(0.25),
                p(0.5),
                p(0.9),
                p(0.999),
                p(1.0)
            );
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
