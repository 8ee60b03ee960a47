//! The device blocks of failed loads the engine hears of (`take_load_errors`): every failed
//! load's, or, for one KV cache group of several (`set_sync_load_errors_only`), only those of
//! loads inside the step. vLLM recomputes a hybrid model's failed asynchronous load by request
//! (`failed_recving`, from the `load_failed` list of `get_finished`), so its block ids must not
//! reach vLLM too; a failed load inside the step has no such path, so its blocks do, and vLLM
//! stops rather than compute on them (`Scheduler._handle_invalid_blocks` takes no block ids from
//! a model with several groups).
//!
//! Invariant: a failed load's blocks are noted once, when it is known failed, and handed out
//! once; with sync-only errors an asynchronous load's never are.
use crate::connector::worker::Worker;
use crate::ids::DeviceBlockId;

impl Worker {
    /// Hand out only the blocks of failed loads inside the step (see the module
    /// documentation). Off by default.
    pub fn set_sync_load_errors_only(&mut self, yes: bool) {
        self.sync_load_errors_only = yes;
    }

    /// Note the blocks of a load that failed; `sync`: a load inside the step.
    pub(super) fn note_load_errors(
        &mut self,
        blocks: impl IntoIterator<Item = DeviceBlockId>,
        sync: bool,
    ) {
        if sync || !self.sync_load_errors_only {
            self.load_errors.extend(blocks);
        }
    }

    /// Device blocks whose load failed since the last call (the engine recomputes them).
    pub fn take_load_errors(&mut self) -> Vec<DeviceBlockId> {
        self.drain();
        std::mem::take(&mut self.load_errors)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::mpsc::channel;

    use crate::connector::messages::{RequestLoad, StepMetadata, PROTOCOL_VERSION};
    use crate::connector::testing::FaultyTransfer;
    use crate::connector::worker::{Worker, WorkerLink};
    use crate::ids::{BlockId, DeviceBlockId, JobId};
    use crate::transfer::TransferJob;

    fn load(request: &str, sync: bool, job: u64, host: u32, device: u32) -> RequestLoad {
        RequestLoad {
            request: request.into(),
            sync,
            jobs: vec![TransferJob::from_pairs(
                JobId(job),
                [(BlockId(host), DeviceBlockId(device))],
            )],
            failed_devices: vec![DeviceBlockId(device + 10)],
        }
    }

    /// One sync and one async load of one step, every host block failing, and one block each
    /// the scheduler side failed: all of them reach the engine, or with sync-only errors only
    /// the sync load's.
    #[test]
    fn only_loads_inside_the_step_are_handed_out_when_asked() {
        for sync_only in [false, true] {
            let faulty = FaultyTransfer::failing_host_reads(8, 16, 8, 0..8);
            let (tx, _rx) = channel();
            let mut w = Worker::new(faulty, WorkerLink::in_process(0, 1, tx));
            w.set_sync_load_errors_only(sync_only);
            w.bind(&StepMetadata {
                version: PROTOCOL_VERSION,
                step: 1,
                loads: vec![load("s", true, 1, 0, 2), load("a", false, 2, 1, 3)],
                ..Default::default()
            });
            w.start_load(None);
            w.wait_for_layer_load(0);
            w.wait_idle();
            let mut got = w.take_load_errors();
            got.sort();
            let want: Vec<u32> = if sync_only {
                vec![2, 12]
            } else {
                vec![2, 3, 12, 13]
            };
            assert_eq!(got, want.into_iter().map(DeviceBlockId).collect::<Vec<_>>());
        }
    }
}
