//! Block reads and writes on the disk tier's files: batches of `(slot, key, address)` items,
//! each prepared into one positional vectored request (header page + payload, or one staging
//! buffer when O_DIRECT needs aligned memory), submitted through io_uring or pread/pwrite.
//!
//! Invariants: every item completes with Ok or its own error; a write clears the slot's
//! generation before it starts and publishes it (and queues its journal record) only after all
//! its bytes landed; a read is Ok only if the header and payload verify against the slot's
//! generation, its key, the set id and the key the caller asks for.
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use super::fault::{Fault, FaultOp};
use super::format::{self, Expect, Header, HEADER_BYTES};
use super::store::{DiskStorage, SlotMeta};
use crate::error::BlockIoError;
use crate::sys::file::{IoOp, IoReq, IoSeg};
use crate::sys::job;
use crate::sys::mem::{AlignedBuf, IO_ALIGN};
use crate::sys::uring::Ring;

/// One block operation prepared for submission.
struct Op {
    index: usize,
    slot: u32,
    generation: u64,
    key: u128,
    payload_hash: u64,
    header: AlignedBuf,
    staging: Option<AlignedBuf>,
    req: IoReq,
    /// Keeps `req.fd` open until the operation completed, even if its file is recreated.
    _file: std::sync::Arc<std::fs::File>,
    /// Bytes the operation must move to succeed (before any injected shortening).
    full_len: usize,
    fault: Option<Fault>,
}

/// The fault kind that hits an operation of `op`.
fn fault_op(op: IoOp) -> FaultOp {
    match op {
        IoOp::Read => FaultOp::Read,
        IoOp::Write => FaultOp::Write,
    }
}

impl DiskStorage {
    /// Write blocks: `items[i] = (slot, key, address of block_bytes to write)`; key 0 = unkeyed.
    /// The addresses must stay valid and unwritten until this returns. One result per item.
    pub(crate) fn write_from(&self, items: &[(u32, u128, usize)]) -> Vec<Result<(), BlockIoError>> {
        let mut results: Vec<Result<(), BlockIoError>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.queue_depth as usize * 2) {
            results.extend(self.run_batch(chunk, IoOp::Write));
        }
        results
    }

    /// Read blocks: `items[i] = (slot, key, address of block_bytes to fill)`; key 0 accepts the
    /// key of the slot's last write. A failed item may leave garbage at its address but is
    /// reported as failed.
    pub(crate) fn read_into(&self, items: &[(u32, u128, usize)]) -> Vec<Result<(), BlockIoError>> {
        let mut results: Vec<Result<(), BlockIoError>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.queue_depth as usize * 2) {
            results.extend(self.run_batch(chunk, IoOp::Read));
        }
        results
    }

    fn run_batch(&self, items: &[(u32, u128, usize)], dir: IoOp) -> Vec<Result<(), BlockIoError>> {
        let op_name = dir.name();
        let mut results: Vec<Option<Result<(), BlockIoError>>> =
            (0..items.len()).map(|_| None).collect();
        let mut deleted: Vec<Option<bool>> = vec![None; self.files.len()];
        let mut ops: Vec<Op> = Vec::with_capacity(items.len());
        for (index, &(slot, key, addr)) in items.iter().enumerate() {
            match self.prepare(slot, key, addr, dir, &mut deleted) {
                Ok(op) => ops.push(Op { index, ..op }),
                Err(e) => results[index] = Some(Err(e)),
            }
        }
        // Injected errno faults never reach the kernel.
        let mut reqs = Vec::with_capacity(ops.len());
        let mut issued = Vec::with_capacity(ops.len());
        for (k, op) in ops.iter().enumerate() {
            if let Some(Fault::Errno(e)) = op.fault {
                results[op.index] = Some(Err(BlockIoError::Io {
                    slot: op.slot,
                    op: op_name,
                    source: std::io::Error::from_raw_os_error(e),
                }));
                continue;
            }
            reqs.push(op.req.clone());
            issued.push(k);
        }
        let outcomes = self.submit(&reqs);
        for (k, outcome) in issued.into_iter().zip(outcomes) {
            let op = &ops[k];
            let want = op.full_len;
            let r = match outcome {
                Err(source) => Err(BlockIoError::Io {
                    slot: op.slot,
                    op: op_name,
                    source,
                }),
                Ok(got) if got < want => Err(BlockIoError::Short {
                    slot: op.slot,
                    op: op_name,
                    got,
                    want,
                }),
                Ok(_) if dir == IoOp::Write => {
                    self.meta()[op.slot as usize] = SlotMeta {
                        generation: op.generation,
                        key: op.key,
                    };
                    self.written(op.slot, op.generation, op.key, op.payload_hash);
                    Ok(())
                }
                Ok(_) => self.finish_read(op, items[op.index].2),
            };
            results[op.index] = Some(r);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(BlockIoError::Other("operation was not run".into()))))
            .collect()
    }

    /// Replaces data file `i`, whose path was deleted (or replaced), by a fresh empty file and
    /// forgets the slots it held; true once the file in use is linked again (another thread may
    /// have done it). The old descriptor closes when the last operation holding it completes.
    fn recreate(&self, i: usize) -> bool {
        let cf = &self.files[i];
        let mut g = cf.file.write().unwrap_or_else(|p| p.into_inner());
        if g.metadata().is_ok_and(|m| m.nlink() > 0) {
            return true;
        }
        let mode = if self.direct {
            super::DirectMode::Require
        } else {
            super::DirectMode::Off
        };
        match super::files::open_data_file(&cf.path, cf.len, self.direct, mode, true) {
            Ok(o) => {
                *g = std::sync::Arc::new(o.file);
                drop(g);
                let first = i * self.blocks_per_file as usize;
                let mut meta = self.meta();
                let end = (first + self.blocks_per_file as usize).min(meta.len());
                for m in meta.get_mut(first..end).into_iter().flatten() {
                    *m = SlotMeta::default();
                }
                kvtier::warn_limited!(
                    path = %cf.path.display(),
                    "disk tier: a cache file was deleted; recreated it empty (its blocks are lost)"
                );
                true
            }
            Err(e) => {
                kvtier::warn_limited!(
                    path = %cf.path.display(),
                    error = %e,
                    "disk tier: a cache file was deleted and could not be recreated"
                );
                false
            }
        }
    }

    /// Build the request for one slot (header page + payload, or one staging buffer).
    fn prepare(
        &self,
        slot: u32,
        key: u128,
        addr: usize,
        dir: IoOp,
        deleted: &mut [Option<bool>],
    ) -> Result<Op, BlockIoError> {
        let (file_idx, offset) = self
            .slot_position(slot)
            .ok_or(BlockIoError::OutOfRange(slot))?;
        let cf = &self.files[file_idx];
        let gone = *deleted[file_idx].get_or_insert_with(|| {
            cf.current()
                .metadata()
                .map(|m| m.nlink() == 0)
                .unwrap_or(true)
        });
        if gone {
            if dir == IoOp::Write {
                self.meta()[slot as usize] = SlotMeta::default();
            }
            // A new file takes its place (the blocks it held are lost): later operations work.
            let recreated = self.recreate(file_idx);
            if recreated {
                deleted[file_idx] = Some(false);
            }
            if dir == IoOp::Read || !recreated {
                return Err(BlockIoError::FileDeleted {
                    slot,
                    path: cf.path.clone(),
                });
            }
        }
        let file = cf.current();
        let fault = self
            .faults
            .as_ref()
            .and_then(|f| f.take(fault_op(dir), slot));
        let header =
            AlignedBuf::new(HEADER_BYTES).map_err(|e| BlockIoError::Other(e.to_string()))?;
        let mut op = Op {
            index: 0,
            slot,
            generation: 0,
            key,
            payload_hash: 0,
            header,
            staging: None,
            req: IoReq {
                fd: file.as_raw_fd(),
                offset,
                segs: Vec::new(),
                op: dir,
            },
            _file: file,
            full_len: 0,
            fault,
        };
        let aligned = addr.is_multiple_of(IO_ALIGN) && self.block_bytes.is_multiple_of(IO_ALIGN);
        let zero_copy = aligned || !self.direct;
        if dir == IoOp::Write {
            self.meta()[slot as usize] = SlotMeta::default();
            op.generation = self.next_gen();
            // The caller guarantees `addr..addr+block_bytes` is valid and unwritten until this
            // call returns.
            op.payload_hash = job::with_bytes(addr, self.block_bytes, |payload| {
                format::payload_hash(payload, op.generation)
            });
            let h = Header {
                slot,
                generation: op.generation,
                len: self.block_bytes as u64,
                payload_hash: op.payload_hash,
                set_id: self.set_id,
                key,
            };
            if zero_copy {
                h.encode(op.header.as_mut_slice());
            } else {
                let mut st = AlignedBuf::new(self.slot_bytes)
                    .map_err(|e| BlockIoError::Other(e.to_string()))?;
                let s = st.as_mut_slice();
                h.encode(&mut s[..HEADER_BYTES]);
                job::read_into_slice(addr, &mut s[HEADER_BYTES..HEADER_BYTES + self.block_bytes]);
                op.staging = Some(st);
            }
        } else {
            let m = self.meta()[slot as usize];
            if m.generation == 0 {
                return Err(BlockIoError::NotWritten(slot));
            }
            if key != 0 && key != m.key {
                return Err(BlockIoError::Corrupt {
                    slot,
                    what: format!("holds key {:#034x}, not the requested {key:#034x}", m.key),
                });
            }
            op.generation = m.generation;
            op.key = m.key;
            if !zero_copy {
                op.staging = Some(
                    AlignedBuf::new(self.slot_bytes)
                        .map_err(|e| BlockIoError::Other(e.to_string()))?,
                );
            }
        }
        op.req.segs = match &op.staging {
            Some(st) => vec![IoSeg {
                addr: st.addr(),
                len: self.slot_bytes,
            }],
            None => {
                // Buffered I/O of an unaligned size needs no padding; O_DIRECT only gets here
                // with aligned sizes.
                vec![
                    IoSeg {
                        addr: op.header.addr(),
                        len: HEADER_BYTES,
                    },
                    IoSeg {
                        addr,
                        len: self.block_bytes,
                    },
                ]
            }
        };
        op.full_len = op.req.total_len();
        if let Some(Fault::Short(n)) = op.fault {
            let mut total = 0;
            let mut segs = Vec::new();
            for s in &op.req.segs {
                let take = s.len.min(n.saturating_sub(total));
                if take > 0 {
                    segs.push(IoSeg {
                        addr: s.addr,
                        len: take,
                    });
                }
                total += take;
            }
            op.req.segs = segs;
        }
        Ok(op)
    }

    fn finish_read(&self, op: &Op, dst: usize) -> Result<(), BlockIoError> {
        let (hdr, payload_addr) = match &op.staging {
            Some(st) => (
                st.as_slice()[..HEADER_BYTES].to_vec(),
                st.addr() + HEADER_BYTES,
            ),
            None => (op.header.as_slice().to_vec(), dst),
        };
        if let Some(Fault::FlipByte(k)) = op.fault {
            let k = k.min(self.block_bytes - 1);
            // `payload_addr` is either our staging buffer or the caller's block, both valid and
            // exclusively ours until this call returns.
            job::with_bytes_mut(payload_addr, self.block_bytes, |p| p[k] ^= 0x01);
        }
        let want = Expect {
            slot: op.slot,
            generation: op.generation,
            set_id: self.set_id,
            key: op.key,
            len: self.block_bytes as u64,
        };
        // As above; the slice is dropped before the caller regains the memory.
        job::with_bytes(payload_addr, self.block_bytes, |payload| {
            format::verify(&hdr, payload, &want)
        })
        .map_err(|what| BlockIoError::Corrupt {
            slot: op.slot,
            what,
        })?;
        if op.staging.is_some() {
            // `dst` is the caller's block (valid, exclusive for this call), the staging buffer
            // is ours; they do not overlap.
            job::copy(payload_addr, dst, self.block_bytes);
        }
        Ok(())
    }

    fn submit(&self, reqs: &[IoReq]) -> Vec<std::io::Result<usize>> {
        if reqs.is_empty() {
            return Vec::new();
        }
        if self.use_uring {
            let ring = self.rings.lock().ok().and_then(|mut r| r.pop());
            let ring = match ring {
                Some(r) => Ok(r),
                None => Ring::new(self.queue_depth),
            };
            if let Ok(mut ring) = ring {
                // Every segment is a header/staging buffer owned by an `Op` that lives until the
                // caller has consumed the results, or a caller block valid for the whole
                // operation (see `write_from`/`read_into`).
                let out = job::run_requests(Some(&mut ring), reqs);
                if let Ok(mut r) = self.rings.lock() {
                    r.push(ring);
                }
                return out;
            }
        }
        job::run_requests(None, reqs)
    }
}
