//! A file's mapped pages lent to the device ([`Engine::lend`](crate::device::Engine::lend)):
//! `cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY` page-locks the page cache's own pages
//! where they are, so the copy engine reads them with no CPU copy into a staging buffer; they are
//! unregistered once the block's copies are through (the staging buffer is dropped after its
//! fence), then unmapped.
//!
//! Read-only matters: asked for write access, the kernel would pin a private file mapping's
//! pages only after copying each out of the page cache (copy on write), a CPU copy again. The
//! mapping is made read-only first, so a driver that ignored the flag fails instead of copying.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use super::{check, driver, Gpu};
use crate::device::{Staging, StagingMemory};
use crate::error::{Error, Result};
use crate::memory::HostBuffer;

/// A registered mapping: unregistered, then unmapped, when dropped.
pub struct Lent {
    base: usize,
    gpu: Arc<Gpu>,
    memory: Option<HostBuffer>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let memory = self.memory.take();
        if !self.gpu.here() {
            // A forked child: the registration is the parent's, its own mapping a copy.
            return;
        }
        let (api, base) = (self.gpu.api, self.base);
        let unregistered = self.gpu.borrow(|| {
            // SAFETY: registered by `lend` in this process; the copies from it are complete
            // (the pipeline drops a staging buffer only after its fence passed).
            check(api, "cuMemHostUnregister", unsafe {
                (api.cuMemHostUnregister)(base as *mut c_void)
            })
        });
        if unregistered.is_err() {
            // Still registered as far as the driver knows: keep the pages mapped.
            std::mem::forget(memory);
        }
    }
}

/// `memory`'s pages page-locked in place for copies to `gpu` (its context bound).
pub(super) fn lend(gpu: &Arc<Gpu>, memory: HostBuffer) -> Result<Staging> {
    let (base, len) = match memory.pages_read_only() {
        Some(Ok(pages)) => pages,
        Some(Err(e)) => {
            return Err(Error::device(format!(
                "the file's mapped pages could not be made read-only: {e}"
            )))
        }
        None => return Err(Error::device("only a file's mapped pages can be lent")),
    };
    let api = gpu.api;
    let flags = driver::CU_MEMHOSTREGISTER_PORTABLE | driver::CU_MEMHOSTREGISTER_READ_ONLY;
    let started = Instant::now();
    // SAFETY: `[base, base + len)` is a live read-only mapping, kept mapped until it is
    // unregistered (`Lent::drop`).
    check(
        api,
        "cuMemHostRegister (a file's pages, read-only)",
        unsafe { (api.cuMemHostRegister_v2)(base as *mut c_void, len, flags) },
    )?;
    let took = started.elapsed();
    Ok(Staging {
        ptr: NonNull::new(memory.as_ptr()).expect("a mapping is not at address 0"),
        len: memory.len(),
        pinned_in: None,
        lent_in: Some(took),
        _memory: StagingMemory::Lent(Lent {
            base,
            gpu: gpu.clone(),
            memory: Some(memory),
        }),
    })
}
