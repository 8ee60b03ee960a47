//! The transfer engine's node path: with the node tier as the remote store, device <-> remote
//! jobs copy between the engine's blocks and arena slots directly (stores: `Reserve`, the
//! copy, `Finish`; loads: `Lease`, the copy, `EndLeases`; in parts whose round trips run beside
//! each other's copies, `pipeline.rs`, except an ordered load: one part, `batch.rs`), with no
//! staging buffer in between. On a CUDA
//! engine the arena mapping is registered with the driver (`NodeStore::use_cuda`), so those
//! copies are DMA; when it is not registered the job returns `None` and the engine stages it
//! through its bounce buffer as for any remote store.
//!
//! A synchronous load is ordered on the engine's stream (layered where the layout allows) only
//! when every pair was leased and passed its checks; the leases end after the copies completed.
//!
//! Invariant: every pair of the job is either done or listed failed with its reason (a full node,
//! a missing or damaged block, a device copy error, a connection lost before the node
//! acknowledged the pair). After an ordered load let the engine go on, a pair fails only if the
//! connection broke during the copy (the node may then have ended the lease).
use kvtier::hash::SequenceHash;
use kvtier::ids::DeviceBlockId;
use kvtier::transfer::Fence;

use super::client::NodeStore;
use crate::transfer::device::{CopyDir, DeviceKind, DeviceSide, Order};

/// Run a job of pairs `(devs[i], keys[i])` (`pairs = (devs, keys)`; device -> remote for
/// `DeviceToHost`, else remote -> device) on the node's arena.
/// Returns the failed pairs, or `None` when the job must be staged instead. `order` (a
/// synchronous load): the device leg is ordered on the engine's stream (layered where it can
/// be) when every pair was leased and passed its checks, so the engine goes on once the copies
/// are enqueued; else the order is dropped unused and the engine waits for the job's outcome.
pub(crate) fn run(
    dev: &DeviceSide,
    node: &NodeStore,
    pairs: (&[DeviceBlockId], &[SequenceHash]),
    fence: &Fence,
    bytes: usize,
    way: CopyDir,
    order: Order<'_>,
) -> Option<Vec<(usize, String)>> {
    let store = way.to_host();
    let (devs, keys) = pairs;
    let mut failed = Vec::new();
    let keys: Vec<u128> = keys.iter().map(|k| k.0).collect();
    if keys.is_empty() {
        return Some(failed);
    }
    let need_cuda = matches!(dev.kind(), DeviceKind::Cuda(_));
    // Only a load may be ordered; the leg checks that every pair was leased.
    let whole = keys.len();
    let order = order.filter(|_| !store).map(|mut o| {
        // The direct path copies from leased slots of the arena, which `direct_conn` only
        // hands a CUDA job once the arena is registered with the driver.
        o.readable = true;
        o
    });
    let dir = if store { "device read" } else { "device write" };
    let leg = |items: &[(usize, usize)], order: Order<'_>| -> Vec<(usize, String)> {
        let dev_items: Vec<(usize, u32, usize)> = items
            .iter()
            .filter_map(|&(k, addr)| Some((k, devs.get(k)?.0, addr)))
            .collect();
        dev.copy(&dev_items, way, fence, order)
            .into_iter()
            .map(|(k, why)| (k, format!("{dir}: {why}")))
            .collect()
    };
    let out = match order {
        // Every pair leased and passed its checks before the one ordered copy (else the order
        // is dropped and the engine waits for the outcome).
        Some(o) => node.load_direct(
            &keys,
            bytes,
            need_cuda,
            Box::new(|items: &[(usize, usize)]| {
                let o = Some(o).filter(|_| items.len() == whole);
                leg(items, o)
            }),
        )?,
        // Stores and unordered loads in parts: the node's round trips beside the copies.
        None if store => node.store_direct(&keys, bytes, need_cuda, &mut |i| leg(i, None))?,
        None => node.load_in_parts(&keys, bytes, need_cuda, &mut |i| leg(i, None))?,
    };
    let op = if store { "node put" } else { "node get" };
    for (k, r) in out.into_iter().enumerate() {
        if let Err(why) = r {
            failed.push((k, format!("{op}: {why}")));
        }
    }
    Some(failed)
}
