//! Device memory that the driver allocates, for the Rust-only path (`fastload bench --device
//! cuda`); the Python bindings let torch allocate instead.

use std::sync::Arc;

use super::{check, Gpu};
use crate::device::{Allocation, Allocator, Destination};
use crate::error::Result;
use crate::plan::TensorSlot;

/// Device memory from `cuMemAlloc`, freed when dropped.
struct DeviceMemory {
    gpu: Arc<Gpu>,
    ptr: u64,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if !self.gpu.here() {
            return;
        }
        let (api, ptr) = (self.gpu.api, self.ptr);
        let _ = self.gpu.borrow(|| {
            // SAFETY: allocated by `cuMemAlloc`, freed once.
            check(api, "cuMemFree", unsafe { (api.cuMemFree_v2)(ptr) })
        });
    }
}

/// Destinations allocated by the driver, one per segment with the tensors at their offsets: the
/// Rust-only path (`fastload bench --device cuda`). The Python bindings let torch allocate instead
/// (see `src/python/stream.rs`), so that its caching allocator accounts for the memory.
pub struct CudaAllocator {
    gpu: Arc<Gpu>,
}

impl CudaAllocator {
    pub fn new(ordinal: usize) -> Result<CudaAllocator> {
        Ok(CudaAllocator {
            gpu: Gpu::get(ordinal)?,
        })
    }
}

impl Allocator for CudaAllocator {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        self.gpu.bind()?;
        let api = self.gpu.api;
        let total: u64 = tensors.iter().map(|t| t.len.div_ceil(256) * 256).sum();
        let mut base = 0;
        // SAFETY: allocates `total` bytes of device memory in the bound context.
        check(api, "cuMemAlloc", unsafe {
            (api.cuMemAlloc_v2)(&mut base, total.max(1) as usize)
        })?;
        let memory = Arc::new(DeviceMemory {
            gpu: self.gpu.clone(),
            ptr: base,
        });
        let mut at = base;
        let destinations = tensors
            .iter()
            .map(|t| {
                let d = Destination {
                    addr: at,
                    owner: Box::new(memory.clone()),
                };
                at += t.len.div_ceil(256) * 256;
                d
            })
            .collect();
        Ok(Allocation {
            destinations,
            stream: None,
        })
    }
}
