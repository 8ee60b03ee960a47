//! The staged path of the [`TransferEngine`]: device <-> disk and device <-> remote jobs through
//! a private bounce buffer per direction (see the parent module's comment for the slicing).
//!
//! Invariants: a bounce buffer is used by one job at a time (its mutex), each half by one leg at
//! a time, and a slice's second leg starts only after its first leg completed; a pair whose disk
//! or remote leg failed never touches engine memory.
use std::sync::Mutex;

use kvtier::ids::DeviceBlockId;
use kvtier::transfer::{Blocks, Fence};

use super::{Results, TransferEngine};
use crate::error::IoError;
use crate::storage::host::{HostOptions, HostStorage, PinMode};
use crate::transfer::device::{CopyDir, DeviceKind};

/// A bounce buffer: a few host blocks, used by one slice of one job at a time.
pub(super) struct Bounce {
    pub(super) mem: Mutex<HostStorage>,
    pub(super) blocks: usize,
}

/// One buffer per direction, so loads and stores never wait for each other.
pub(super) struct Bounces {
    pub(super) load: Bounce,
    pub(super) store: Bounce,
}

impl Bounce {
    /// `blocks` host blocks, pinned for a CUDA device (pageable, with a warning, if pinning
    /// fails), plain memory for a CPU device.
    pub(super) fn new(
        blocks: u32,
        bytes_per_block: usize,
        kind: DeviceKind,
    ) -> Result<Self, IoError> {
        let mut opts = HostOptions::new(blocks, bytes_per_block);
        opts.touch_threads = 1;
        opts.pin = match kind {
            DeviceKind::Cpu => PinMode::Never,
            DeviceKind::Cuda(ordinal) => {
                opts.cuda_device = i32::try_from(ordinal)
                    .map_err(|_| IoError::Config(format!("CUDA device {ordinal}")))?;
                PinMode::Require
            }
        };
        let mem = match HostStorage::new(&opts) {
            Ok(m) => m,
            Err(e) if opts.pin == PinMode::Require => {
                tracing::warn!("bounce buffer not pinned ({e}); disk/remote loads will be slower");
                opts.pin = PinMode::Never;
                HostStorage::new(&opts)?
            }
            Err(e) => return Err(e),
        };
        Ok(Bounce {
            mem: Mutex::new(mem),
            blocks: blocks as usize,
        })
    }
}

impl TransferEngine {
    /// Device <-> disk/remote through the bounce buffer of the direction. The buffer is split in
    /// two halves (when it has two blocks or more) and the job runs in slices of one half; slice
    /// `s` uses half `s % 2`. Loads: far leg (disk read / remote get) of a slice, then its device
    /// leg for the pairs whose far leg succeeded; stores: device leg of a slice, then its far leg
    /// for the pairs that copied. With two halves the far leg of one slice (on a scoped helper
    /// thread) runs while the device leg of the neighbouring slice (on this thread, after the
    /// fence) uses the other half; with one half they alternate.
    ///
    /// `devs[i]` and `far`'s block `i` are pair `i`'s blocks; `way` says which is the source.
    pub(super) fn staged(
        &self,
        devs: &[DeviceBlockId],
        far: &Blocks,
        fence: &Fence,
        way: CopyDir,
        res: &mut Results,
    ) {
        let store = way.to_host();
        let (Some(dev), Some(bounces)) = (&self.device, &self.bounce) else {
            for i in 0..devs.len() {
                res.fail(i, "no bounce buffer for device <-> disk/remote");
            }
            return;
        };
        let bounce = if store { &bounces.store } else { &bounces.load };
        // Held for the whole job: both halves are in use at once.
        let mem = bounce.mem.lock().unwrap_or_else(|p| p.into_inner());
        let halves = if bounce.blocks >= 2 { 2 } else { 1 };
        let per = (bounce.blocks / halves).max(1);
        let indices: Vec<usize> = (0..devs.len()).collect();
        let mut slices: Vec<Vec<(usize, usize)>> = Vec::with_capacity(indices.len() / per + 1);
        for (s, chunk) in indices.chunks(per).enumerate() {
            let mut items = Vec::with_capacity(chunk.len());
            for (k, &i) in chunk.iter().enumerate() {
                match mem.block_addr(((s % halves) * per + k) as u32) {
                    Ok(a) => items.push((i, a)),
                    Err(e) => res.fail(i, format!("bounce buffer {e}")),
                }
            }
            slices.push(items);
        }
        let dev_items = |items: &[(usize, usize)]| -> Vec<(usize, u32, usize)> {
            items
                .iter()
                .filter_map(|&(i, a)| Some((i, devs.get(i)?.0, a)))
                .collect()
        };
        // The slice between its first and second leg.
        let mut pending: Vec<(usize, usize)> = Vec::new();
        for s in 0..=slices.len() {
            let next: &[(usize, usize)] = slices.get(s).map_or(&[], Vec::as_slice);
            // Loads: device leg of `pending` beside the far leg of `next`.
            // Stores: far leg of `pending` beside the device leg of `next`.
            let (near_items, far_items) = if store {
                (next, pending.as_slice())
            } else {
                (pending.as_slice(), next)
            };
            let near = || dev.copy(&dev_items(near_items), way, fence, None);
            let far_run = || {
                let mut r = Results {
                    failures: Vec::new(),
                };
                let ok = self.far_leg(far, store, far_items, &mut r);
                (ok, r)
            };
            let sequential = || {
                if store {
                    // One half: the far leg must be done with it before the device leg refills it.
                    let f = far_run();
                    (near(), Some(f))
                } else {
                    // One half: the device leg must be done with it before the far leg refills it.
                    let n = near();
                    (n, Some(far_run()))
                }
            };
            let parallel = halves == 2 && !near_items.is_empty() && !far_items.is_empty();
            let (near_failed, far_out) = if parallel {
                std::thread::scope(|sc| {
                    match std::thread::Builder::new()
                        .name("kvtier-bounce".into())
                        .spawn_scoped(sc, far_run)
                    {
                        Ok(h) => {
                            let n = near();
                            (n, h.join().ok())
                        }
                        Err(e) => {
                            tracing::debug!("no helper thread ({e}): bounce legs in turn");
                            sequential()
                        }
                    }
                })
            } else {
                sequential()
            };
            let dir = if store { "device read" } else { "device write" };
            let mut near_ok = vec![true; near_items.len()];
            for (i, reason) in near_failed {
                if let Some(k) = near_items.iter().position(|&(j, _)| j == i) {
                    near_ok[k] = false;
                }
                res.fail(i, format!("{dir}: {reason}"));
            }
            let far_ok = match far_out {
                Some((ok, r)) => {
                    res.failures.extend(r.failures);
                    ok
                }
                None => {
                    for &(i, _) in far_items {
                        res.fail(i, "internal: the disk/remote leg panicked");
                    }
                    vec![false; far_items.len()]
                }
            };
            // What goes on to its second leg.
            pending = if store {
                next.iter()
                    .zip(near_ok)
                    .filter(|(_, ok)| *ok)
                    .map(|(&x, _)| x)
                    .collect()
            } else {
                next.iter()
                    .zip(far_ok)
                    .filter(|(_, ok)| *ok)
                    .map(|(&x, _)| x)
                    .collect()
            };
        }
    }
}
