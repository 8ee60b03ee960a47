//! The `kvtier` binary: `serve`, `bench`, `inspect`.
#[path = "bench/transfer.rs"]
mod bench_transfer;

fn main() -> anyhow::Result<()> {
    if let Some(r) = bench_transfer::try_run() {
        return r;
    }
    Ok(())
}
