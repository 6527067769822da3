//! Saving tensors that live in device memory (a GPU's): each tensor's bytes are copied out block
//! by block by an [`Engine`] (`cuMemcpyDtoHAsync` on its stream, ordered after the caller's
//! stream) into staging buffers (page-locked for a GPU), and each block goes to the
//! [`FileWriter`] as soon as its copy landed, while the next blocks are still being copied. A
//! block's buffer is held by the writer (an upload part being filled or sent) until its bytes are
//! written, then goes back to the engine's pool.
//!
//! Every staging buffer alive, in a copy or held by the writer, is counted against one budget
//! (`memory_limit`): the copies wait for the writer to give buffers back. The writer may hold one
//! part being filled (an object store's part, [`FileWriter::holds_at_most`]) that only more bytes
//! complete, so the budget is at least that part and two blocks: there is always room for the
//! block that completes it.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;

use crate::device::{Engine, Fence, Staging};
use crate::error::Result;
use crate::sink::FileWriter;

/// The largest block copied at once.
pub const MAX_BLOCK: usize = 8 << 20;
/// Blocks in the copy queue ahead of the one being written, at most.
const AHEAD: usize = 4;
const PAGE: usize = 4096;

/// The bytes of one tensor in device memory, and what keeps that memory allocated until every
/// copy from it is done (the caller's tensor).
pub struct DeviceBytes {
    /// Device address of the first byte.
    pub addr: u64,
    pub len: u64,
    /// The stream whose queued work must finish before the bytes are read (the work that
    /// produces them: a `CUstream` handle, 0 for the legacy default stream); `None`: nothing.
    pub stream: Option<u64>,
    pub owner: Box<dyn Any + Send>,
}

/// Staging bytes counted against the budget, given back when dropped.
struct Budget {
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl Budget {
    fn try_take(self: &Arc<Self>, n: u64) -> Option<Permit> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if *used + n > self.limit {
            return None;
        }
        *used += n;
        Some(Permit {
            budget: self.clone(),
            n,
        })
    }

    /// Waits until `n` bytes fit: the writer gives buffers back as their parts are uploaded.
    fn take(self: &Arc<Self>, n: u64) -> Permit {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while *used + n > self.limit {
            used = self.freed.wait(used).unwrap_or_else(|e| e.into_inner());
        }
        *used += n;
        Permit {
            budget: self.clone(),
            n,
        }
    }
}

struct Permit {
    budget: Arc<Budget>,
    n: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|e| e.into_inner());
        *used -= self.n;
        self.budget.freed.notify_all();
    }
}

/// A block whose copy landed, handed to the writer: its staging buffer and budget are given back
/// when the writer drops it.
struct Landed {
    staging: Staging,
    len: usize,
    _permit: Permit,
}

impl AsRef<[u8]> for Landed {
    fn as_ref(&self) -> &[u8] {
        #[allow(unsafe_code)]
        // SAFETY: `len` <= the buffer's length; the copy into it completed (its fence passed)
        // and nothing writes it any more.
        unsafe {
            std::slice::from_raw_parts(self.staging.as_ptr(), self.len)
        }
    }
}

/// A block being copied.
struct InFlight {
    staging: Staging,
    len: usize,
    permit: Permit,
    fence: Fence,
}

/// Copies device tensors out for one file's writer.
pub struct DeviceSaver {
    budget: Arc<Budget>,
    block: usize,
}

impl DeviceSaver {
    /// A saver whose staging buffers (in copies and held by the writer) stay within
    /// `memory_limit` bytes, raised to what a writer that holds `holds` bytes needs to progress.
    pub fn new(memory_limit: u64, holds: u64) -> DeviceSaver {
        let block = block_size(memory_limit);
        let limit = memory_limit.max(holds + 2 * block as u64);
        DeviceSaver {
            budget: Arc::new(Budget {
                limit,
                used: Mutex::new(0),
                freed: Condvar::new(),
            }),
            block,
        }
    }

    /// Bytes per copy (the last block of a tensor may be shorter).
    pub fn block_size(&self) -> usize {
        self.block
    }

    /// Staging bytes alive at most.
    pub fn limit(&self) -> u64 {
        self.budget.limit
    }

    /// Writes `tensor`'s bytes as the next tensor of `writer`, copied by `engine` (whose device
    /// memory it is). Returns once every copy from it is done (on failure too): `tensor.owner`
    /// may be dropped then.
    pub fn write(
        &self,
        writer: &mut FileWriter,
        engine: &dyn Engine,
        tensor: DeviceBytes,
    ) -> Result<()> {
        if tensor.len == 0 {
            return writer.write_part(Bytes::new());
        }
        engine.enter()?;
        engine.keep_staging(self.budget.limit);
        if let Some(stream) = tensor.stream {
            engine.order_after(stream)?;
        }
        let mut queue = VecDeque::new();
        let out = self.run(writer, engine, &tensor, &mut queue);
        if out.is_err() {
            // Copies still queued write into buffers about to be freed: let them finish first.
            for block in queue.drain(..) {
                let _ = engine.wait(block.fence);
                drop(block.staging);
            }
        }
        drop(tensor.owner);
        out
    }

    fn run(
        &self,
        writer: &mut FileWriter,
        engine: &dyn Engine,
        tensor: &DeviceBytes,
        queue: &mut VecDeque<InFlight>,
    ) -> Result<()> {
        let cost = engine.staging_size(self.block) as u64;
        let mut next = 0u64;
        loop {
            // Start copies ahead while the budget allows; with none in flight, wait for room
            // (the writer gives buffers back as their parts are uploaded).
            while next < tensor.len && queue.len() < AHEAD {
                let permit = match self.budget.try_take(cost) {
                    Some(p) => p,
                    None if queue.is_empty() => self.budget.take(cost),
                    None => break,
                };
                let len = (tensor.len - next).min(self.block as u64) as usize;
                // Always a whole block: one buffer size, reused from the engine's pool.
                let mut staging = engine.staging(self.block)?;
                let dst = staging.slice_mut(len).as_mut_ptr();
                #[allow(unsafe_code)]
                // SAFETY: `staging` stays in the queue (alive, unread) until the fence recorded
                // next passed; the caller keeps the tensor's memory allocated (its owner) until
                // `write` returns, after every copy from it is done.
                unsafe {
                    engine.copy_to_host(dst, tensor.addr + next, len)?;
                }
                let fence = engine.record()?;
                queue.push_back(InFlight {
                    staging,
                    len,
                    permit,
                    fence,
                });
                next += len as u64;
            }
            let Some(block) = queue.pop_front() else {
                return Ok(());
            };
            engine.wait(block.fence)?;
            let landed = Landed {
                staging: block.staging,
                len: block.len,
                _permit: block.permit,
            };
            writer.write_part(Bytes::from_owner(landed))?;
        }
    }
}

/// Bytes per block for `memory_limit`: a quarter of it (at least a page, at most [`MAX_BLOCK`]),
/// in whole pages, so that copies run ahead of the writer.
pub fn block_size(memory_limit: u64) -> usize {
    let quarter = usize::try_from(memory_limit / 4).unwrap_or(usize::MAX);
    (quarter.clamp(PAGE, MAX_BLOCK) / PAGE) * PAGE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostEngine;
    use crate::sink::{TensorSpec, WriteOptions};

    #[test]
    fn block_sizes() {
        assert_eq!(block_size(1 << 20), 256 << 10);
        assert_eq!(block_size(256 << 20), MAX_BLOCK);
        assert_eq!(block_size(100), PAGE);
        assert_eq!(block_size((2 << 20) + (16 << 10)), 516 << 10);
    }

    #[test]
    fn device_bytes_are_written_block_by_block_within_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.safetensors");
        let data: Vec<Vec<u8>> = [300_000usize, 0, 5]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 7 + i) as u8).collect())
            .collect();
        let specs: Vec<TensorSpec> = data
            .iter()
            .enumerate()
            .map(|(i, d)| TensorSpec {
                name: format!("t{i}"),
                dtype: crate::format::Dtype::U8,
                shape: vec![d.len() as u64],
            })
            .collect();
        let uri = path.to_str().unwrap();
        let mut writer = FileWriter::create(uri, &specs, None, &WriteOptions::default()).unwrap();
        let saver = DeviceSaver::new(64 << 10, writer.holds_at_most());
        assert_eq!(saver.block_size(), 16 << 10);
        let engine = HostEngine::new();
        for &at in writer.order().to_vec().iter() {
            let d = data[at].clone();
            let tensor = DeviceBytes {
                addr: d.as_ptr() as u64,
                len: d.len() as u64,
                stream: None,
                owner: Box::new(d),
            };
            saver.write(&mut writer, &engine, tensor).unwrap();
            assert_eq!(*saver.budget.used.lock().unwrap(), 0);
        }
        writer.finish().unwrap();
        let file = std::fs::read(&path).unwrap();
        let header = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        let body = &file[8 + header..];
        // safetensors orders by dtype alignment, then name: all U8 here, by name.
        let want: Vec<u8> = data.concat();
        assert_eq!(body, &want[..]);
    }
}
