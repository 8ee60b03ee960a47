//! Several KV cache groups (vLLM's hybrid KV cache manager: full-attention layers beside
//! sliding-window ones), one [`Leader`] per group: each keys its blocks with its own salt (a
//! block is never served to another group) and keeps its own books; this module holds the rule
//! that joins them.
//!
//! Invariant: a hit is claimed only when every group can supply its part of it: the engine is
//! offered the tokens up to the largest block boundary at which every group's leader finds what
//! that group's attention reads (the whole prefix for full attention, the window of the hit's
//! end for a sliding window), and every group's leader records exactly that match; every group
//! loads it the same way: inside the engine's step only when every group's part lies in the
//! host tier alone (a load that fails only with the device), else asynchronously (vLLM
//! recomputes a hybrid model's failed load only by request, while it waits: `failed_recving`).
use crate::connector::leader::{Leader, RequestKey};
use crate::connector::ConnectorError;
use crate::ids::RequestId;

/// Match `req` in every group: the external tokens all of them can supply (block aligned, 0 if
/// none), recorded by each group's leader as its match. Side-effect free on the pools, like a
/// single leader's match; counted once per leader.
pub fn match_groups(
    leaders: &mut [&mut Leader],
    req: &RequestId,
    all_tokens: &[u32],
    num_computed_tokens: usize,
    key: &RequestKey,
) -> Result<usize, ConnectorError> {
    let mut limit: Option<usize> = None;
    // Each round lowers the limit to the smallest group's end, or ends with all agreeing; a
    // sliding window's answer is not monotonic in the limit, so the round repeats.
    loop {
        let mut ends = Vec::with_capacity(leaders.len());
        for l in leaders.iter_mut() {
            let n = l.match_limited(req, all_tokens, num_computed_tokens, key, limit, false)?;
            ends.push(num_computed_tokens + n);
        }
        let low = ends.iter().copied().min().unwrap_or(num_computed_tokens);
        if low <= num_computed_tokens || ends.iter().all(|e| *e == low) {
            let agreed = if low <= num_computed_tokens {
                num_computed_tokens
            } else {
                low
            };
            // The agreed match, recorded and counted by every group (0 external tokens: none).
            let mut got = 0;
            for l in leaders.iter_mut() {
                got = l.match_limited(
                    req,
                    all_tokens,
                    num_computed_tokens,
                    key,
                    Some(agreed),
                    true,
                )?;
                if num_computed_tokens + got != agreed {
                    // Unreachable while the pools do not change between the calls; a miss
                    // is always safe.
                    return zero(leaders, req, all_tokens, num_computed_tokens, key);
                }
            }
            if leaders
                .iter()
                .any(|l| l.joint_load_mode(req) == Some(false))
            {
                for l in leaders.iter_mut() {
                    l.load_asynchronously(req);
                }
            }
            return Ok(got);
        }
        limit = Some(low);
    }
}

/// Record a miss in every group.
fn zero(
    leaders: &mut [&mut Leader],
    req: &RequestId,
    all_tokens: &[u32],
    num_computed_tokens: usize,
    key: &RequestKey,
) -> Result<usize, ConnectorError> {
    for l in leaders.iter_mut() {
        // A miss holds nothing (the agreed calls before it may have held blocks).
        l.match_limited(
            req,
            all_tokens,
            num_computed_tokens,
            key,
            Some(num_computed_tokens),
            false,
        )?;
    }
    Ok(0)
}
