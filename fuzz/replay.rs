//! Replays a fuzz target as a plain test (included with `#[path]` by
//! crates/kvtier-io/tests/fuzz_corpus.rs and crates/kvtier/tests/fuzz_corpus_zmq.rs): every
//! committed seed of `fuzz/seeds/<target>`, every input of a local `fuzz/corpus/<target>` (made
//! by `fuzz/seed-corpus.sh` and grown by cargo-fuzz; not in git) and a fixed number of
//! deterministic mutations of the seeds (bit flips, truncations, insertions, splices), so CI
//! exercises each decoder beyond its seeds without a fuzzing toolchain. Invariant: the same
//! inputs every run (a fixed xorshift seed), and a panic names the input that caused it.

use std::path::{Path, PathBuf};

/// `fuzz_target!(|data: &[u8]| { .. })` as `pub(crate) fn run(data: &[u8]) { .. }` (the includer
/// writes `extern crate self as libfuzzer_sys;`, so the targets' `use libfuzzer_sys::fuzz_target;`
/// finds this).
#[macro_export]
macro_rules! fuzz_target {
    (|$data:ident: &[u8]| $body:block) => {
        pub(crate) fn run($data: &[u8]) $body
    };
}

/// Mutations of the seeds run per target.
pub(crate) const MUTATIONS: usize = 4096;

fn inputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(PathBuf, Vec<u8>)> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| std::fs::read(&p).ok().map(|b| (p, b)))
        .collect();
    v.sort();
    v
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut XorShift, a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut out = a.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] = rng.next() as u8;
            }
            2 => out.truncate(rng.below(out.len() + 1)),
            3 => {
                let i = rng.below(out.len() + 1);
                out.insert(i, rng.next() as u8);
            }
            _ => {
                let cut = rng.below(out.len() + 1);
                out.truncate(cut);
                out.extend_from_slice(&b[rng.below(b.len() + 1)..]);
            }
        }
    }
    out
}

/// Runs `target` on the seeds, the local corpus and the mutations; the count of inputs run.
pub(crate) fn replay(name: &str, target: fn(&[u8])) -> usize {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let seeds = inputs(&fuzz.join("seeds").join(name));
    assert!(!seeds.is_empty(), "{name}: no seeds in fuzz/seeds/{name}");
    let mut all = seeds.clone();
    all.extend(inputs(&fuzz.join("corpus").join(name)));
    for (path, bytes) in &all {
        let r = std::panic::catch_unwind(|| target(bytes));
        assert!(r.is_ok(), "{name}: input {} panics", path.display());
    }
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for i in 0..MUTATIONS {
        let a = &seeds[rng.below(seeds.len())].1;
        let b = &seeds[rng.below(seeds.len())].1;
        let m = mutate(&mut rng, a, b);
        let r = std::panic::catch_unwind(|| target(&m));
        assert!(r.is_ok(), "{name}: mutation {i} panics: {m:02x?}");
    }
    all.len() + MUTATIONS
}
