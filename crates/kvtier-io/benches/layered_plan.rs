//! The CPU cost of planning a staged layered load (`transfer/cuda/staged.rs`), paid before its
//! first copy: a 32K-token Llama-3.1-8B prompt (2,048 blocks, 32 layers, vLLM's per-layer layout
//! with 32 KiB K and V chunks: 4 GiB) in groups of one layer (64 KiB slices, `staged2d:64`) and
//! of eight (512 KiB, `staged`), staging halves of 8 blocks (16 MiB). The copy it plans takes
//! ~78 ms at 55 GB/s: the plan is on that budget.
//!
//! Run: `cargo bench -p kvtier-io --features testing --bench layered_plan`.
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvtier_io::transfer::cuda::PlanInput;

fn bench(c: &mut Criterion) {
    let input = PlanInput::per_layer(2048, 32, 32 << 10);
    let mut g = c.benchmark_group("staged_plan_4GiB");
    for layers_per_group in [1usize, 8] {
        let (rounds, copies, descs) = input.plan(layers_per_group, 16 << 20).unwrap();
        eprintln!("{layers_per_group} layer(s) per group: {rounds} rounds, {copies} copies, {descs} descriptors");
        g.bench_function(
            BenchmarkId::new("layers_per_group", layers_per_group),
            |b| b.iter(|| input.plan(layers_per_group, 16 << 20).unwrap()),
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(5));
    targets = bench
}
criterion_main!(benches);
