//! Shared by the benches: time `iters` runs of a body on the wall clock (criterion's usual
//! measure) or, with `KVTIER_BENCH_CLOCK=cpu`, on this thread's CPU clock, which leaves out the
//! time the thread spent descheduled on a shared machine (cache interference still counts).
use std::time::{Duration, Instant};

use cpu_time::ThreadTime;

pub(crate) fn cpu_clock() -> bool {
    std::env::var("KVTIER_BENCH_CLOCK").is_ok_and(|v| v == "cpu")
}

pub(crate) fn group_name(base: &str) -> String {
    if cpu_clock() {
        format!("{base}_cputime")
    } else {
        base.to_owned()
    }
}

pub(crate) fn time<F: FnMut()>(iters: u64, mut body: F) -> Duration {
    if cpu_clock() {
        let t = ThreadTime::now();
        for _ in 0..iters {
            body();
        }
        t.elapsed()
    } else {
        let t = Instant::now();
        for _ in 0..iters {
            body();
        }
        t.elapsed()
    }
    .max(Duration::from_nanos(1))
}
