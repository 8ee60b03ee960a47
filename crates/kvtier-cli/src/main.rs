//! The `kvtier` binary: `serve`, `bench`, `inspect`.
fn main() -> anyhow::Result<()> {
    Ok(())
}
