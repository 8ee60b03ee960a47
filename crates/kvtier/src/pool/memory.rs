//! How much memory a pool's books may take: a pool is refused with a typed error, before anything
//! is allocated or touched, when its block records and registry would not fit in the memory the
//! kernel reports available. Without this check a huge `num_blocks` passed the (overcommitted)
//! allocation and then had the process killed or aborted while the records were initialised.
//!
//! Invariant: `check` returns `Ok` only if the bytes needed are at most `MemAvailable` (Linux,
//! `/proc/meminfo`); where that figure is unknown it returns `Ok` and the fallible allocations
//! in `BlockPool::new` are the only guard.
use crate::ids::Tier;

use super::types::PoolError;

/// `MemAvailable` of `/proc/meminfo` in bytes, if readable.
pub(crate) fn available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(text: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a pool of `requested` blocks whose books need `bytes` when less is available.
pub(crate) fn check(tier: Tier, requested: usize, bytes: usize) -> Result<(), PoolError> {
    match available_bytes() {
        Some(avail) if bytes > avail => Err(PoolError::OutOfMemory {
            tier,
            requested,
            bytes,
            available: format!("only {avail} bytes available"),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_mem_available() {
        let t = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   21000000 kB\n";
        assert_eq!(parse_mem_available(t), Some(21_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
    }
}
