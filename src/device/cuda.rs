//! The GPU engine, over cudarc's driver API with the driver loaded at run time.
//!
//! - Probe: `is_culib_present` then `cuInit`, inside `catch_unwind` (cudarc panics when a library
//!   or symbol is missing); the answer is cached per process. Nothing here runs at import.
//! - Context: the device's primary context, the one the CUDA runtime (and so torch) uses, bound
//!   on every thread that calls the driver.
//! - Staging: page-locked, cacheable (`CU_MEMHOSTALLOC_PORTABLE`, not write-combined: object-store
//!   bodies are written into it by ordinary CPU copies) and kept in a process-wide pool, so a
//!   second load reuses the pinned memory of the first instead of pinning again (pinning runs at a
//!   few GB/s and would otherwise be paid per load).
//! - Copies: `cuMemcpyHtoDAsync` on one non-blocking stream per engine; a fence is an event
//!   recorded after a block's copies.
//! - Fork: CUDA cannot be used in a child forked after it was initialised; that gives an error.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{Allocation, Allocator, Destination, Engine, Fence, Staging, StagingMemory};
use crate::error::{Error, Result};
use crate::plan::TensorSlot;

fn driver_error(what: &str, e: DriverError) -> Error {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Error::device(format!("CUDA {what} failed: {name} ({text})"))
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs a driver call that cudarc may turn into a panic (missing library or symbol).
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(Error::device(format!("CUDA {what}: {}", panic_text(p)))))
}

/// The driver's version (e.g. 12080), after loading and initialising it once per process.
pub fn driver_version() -> Result<i32> {
    static PROBE: OnceLock<std::result::Result<i32, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            guarded("driver probe", || {
                // SAFETY: loads and unloads the library to see whether it exists.
                if !unsafe { sys::is_culib_present() } {
                    return Err(Error::device(
                        "CUDA driver not found: libcuda.so could not be loaded (is an NVIDIA \
                         driver installed, and this a GPU machine?)",
                    ));
                }
                result::init().map_err(|e| driver_error("initialisation (cuInit)", e))?;
                let mut version = 0;
                // SAFETY: writes one int.
                unsafe { sys::cuDriverGetVersion(&mut version) }
                    .result()
                    .map_err(|e| driver_error("cuDriverGetVersion", e))?;
                Ok(version)
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::device)
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    driver_version()?;
    guarded("device count", || {
        result::device::get_count()
            .map(|n| n as usize)
            .map_err(|e| driver_error("cuDeviceGetCount", e))
    })
}

/// One device's primary context, retained for the life of the process.
struct Gpu {
    ordinal: usize,
    ctx: usize,
    pid: u32,
}

impl Gpu {
    fn get(ordinal: usize) -> Result<Arc<Gpu>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::option(
                "device",
                format!("cuda:{ordinal} does not exist: this machine has {count} CUDA device(s)"),
            ));
        }
        let mut gpus = GPUS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(gpu) = gpus.get(&ordinal) {
            if gpu.pid != std::process::id() {
                return Err(Error::device(
                    "CUDA was initialised before this process was forked; a forked child cannot \
                     use it (start workers with the 'spawn' method)",
                ));
            }
            return Ok(gpu.clone());
        }
        let gpu = guarded("context", || {
            let dev =
                result::device::get(ordinal as i32).map_err(|e| driver_error("cuDeviceGet", e))?;
            // SAFETY: retains (creating if needed) the device's primary context; never released,
            // like the runtime does.
            let ctx = unsafe { result::primary_ctx::retain(dev) }
                .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
            Ok(Arc::new(Gpu {
                ordinal,
                ctx: ctx as usize,
                pid: std::process::id(),
            }))
        })?;
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { result::ctx::set_current(self.ctx as sys::CUcontext) }
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// Runs `f` with this context bound, then puts back the calling thread's own (or none): the
    /// thread may be a consumer's, whose CUDA runtime (torch) takes its current device from it.
    fn borrow<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let previous = result::ctx::get_current()
            .map_err(|e| driver_error("cuCtxGetCurrent", e))?
            .unwrap_or(std::ptr::null_mut());
        self.bind()?;
        let out = f();
        if previous as usize != self.ctx {
            // SAFETY: the context that was current here a moment ago (or none).
            unsafe { result::ctx::set_current(previous) }
                .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        }
        out
    }
}

/// A recorded CUDA event, destroyed when dropped.
pub struct Event(usize);

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `event::create`, destroyed once.
        let _ = unsafe { result::event::destroy(self.0 as sys::CUevent) };
    }
}

/// A page-locked buffer nobody uses, kept for the next load.
struct Cached {
    addr: usize,
    cap: usize,
    gpu: Arc<Gpu>,
}

struct PinnedPool {
    free: Vec<Cached>,
    cached: usize,
    limit: usize,
}

static PINNED: Mutex<PinnedPool> = Mutex::new(PinnedPool {
    free: Vec::new(),
    cached: 0,
    limit: 0,
});

/// Sets how many bytes of page-locked staging memory stay cached between loads (at least what
/// an earlier load of this process asked for, until [`release_pinned`]).
pub fn set_pinned_limit(bytes: usize) {
    let mut pool = PINNED.lock().unwrap_or_else(|e| e.into_inner());
    pool.limit = pool.limit.max(bytes);
}

/// Bytes of page-locked memory cached for the next load.
pub fn pinned_cached() -> usize {
    PINNED.lock().unwrap_or_else(|e| e.into_inner()).cached
}

/// Frees every cached page-locked buffer and stops caching until the next GPU load: buffers in
/// use are freed when their load is done with them. Returns the bytes freed.
pub fn release_pinned() -> usize {
    let free = {
        let mut pool = PINNED.lock().unwrap_or_else(|e| e.into_inner());
        pool.limit = 0;
        pool.cached = 0;
        std::mem::take(&mut pool.free)
    };
    free.into_iter()
        .map(|c| {
            free_pinned(c.addr, &c.gpu);
            c.cap
        })
        .sum()
}

/// Gives page-locked memory back to the driver, in the context that allocated it (from any
/// thread). In a child forked after CUDA was initialised the driver cannot be called: the memory
/// is left as it is.
fn free_pinned(addr: usize, gpu: &Gpu) {
    if gpu.pid != std::process::id() {
        return;
    }
    let _ = guarded("cuMemFreeHost", || {
        gpu.borrow(|| {
            // SAFETY: allocated by `malloc_host` in this process, no longer referenced.
            unsafe { result::free_host(addr as *mut c_void) }
                .map_err(|e| driver_error("cuMemFreeHost", e))
        })
    });
}

/// Page-locked host memory from the pool; returns there when dropped.
pub struct Pinned {
    addr: usize,
    cap: usize,
    gpu: Arc<Gpu>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut pool = PINNED.lock().unwrap_or_else(|e| e.into_inner());
        if pool.cached + self.cap <= pool.limit {
            pool.cached += self.cap;
            pool.free.push(Cached {
                addr: self.addr,
                cap: self.cap,
                gpu: self.gpu.clone(),
            });
        } else {
            drop(pool);
            free_pinned(self.addr, &self.gpu);
        }
    }
}

/// Takes the cached buffer that best fits `cap` bytes, wasting at most half: page-locked
/// buffers cannot be split or moved (the driver registered them as they are), and reusing one
/// beats allocating another by far.
fn take_best_fit(free: &mut Vec<Cached>, cap: usize) -> Option<Cached> {
    let best = free
        .iter()
        .enumerate()
        .filter(|(_, c)| c.cap >= cap && c.cap - cap <= cap / 2)
        .min_by_key(|(_, c)| c.cap)
        .map(|(i, _)| i)?;
    Some(free.swap_remove(best))
}

/// `len` bytes (rounded up) of page-locked memory; `gpu`'s context is bound.
fn pinned(gpu: &Arc<Gpu>, len: usize) -> Result<Pinned> {
    const GRAIN: usize = 64 << 10;
    let cap = len.max(1).div_ceil(GRAIN) * GRAIN;
    {
        let mut pool = PINNED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = take_best_fit(&mut pool.free, cap) {
            pool.cached -= c.cap;
            return Ok(Pinned {
                addr: c.addr,
                cap: c.cap,
                gpu: c.gpu,
            });
        }
    }
    // SAFETY: allocates `cap` bytes of page-locked memory, usable from every context.
    let ptr = unsafe { result::malloc_host(cap, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| driver_error("cuMemHostAlloc (page-locked staging memory)", e))?;
    Ok(Pinned {
        addr: ptr as usize,
        cap,
        gpu: gpu.clone(),
    })
}

/// Copies into memory of one CUDA device, on a dedicated stream.
pub struct CudaEngine {
    gpu: Arc<Gpu>,
    stream: usize,
}

impl CudaEngine {
    pub fn new(ordinal: usize) -> Result<CudaEngine> {
        let gpu = Gpu::get(ordinal)?;
        // Called on the consumer's thread: its current context stays as it was.
        let stream = guarded("stream", || {
            gpu.borrow(|| {
                result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(|e| driver_error("cuStreamCreate", e))
            })
        })?;
        Ok(CudaEngine {
            gpu,
            stream: stream as usize,
        })
    }

    fn stream(&self) -> sys::CUstream {
        self.stream as sys::CUstream
    }

    fn event(&self) -> Result<Event> {
        // Blocking sync: the completion thread sleeps in cuEventSynchronize instead of spinning
        // on a core that the reads need; a wake-up costs microseconds against a block's copy
        // time of hundreds.
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        let mut event = std::mem::MaybeUninit::uninit();
        // SAFETY: writes one event handle; checked before use.
        unsafe {
            sys::cuEventCreate(event.as_mut_ptr(), flags)
                .result()
                .map_err(|e| driver_error("cuEventCreate", e))?;
            Ok(Event(event.assume_init() as usize))
        }
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let stream = self.stream();
        // The last owner may be the consumer's thread: borrow the context.
        let _ = self.gpu.borrow(|| {
            // SAFETY: our stream; cuStreamDestroy lets queued work finish first.
            unsafe { result::stream::destroy(stream) }
                .map_err(|e| driver_error("cuStreamDestroy", e))
        });
    }
}

impl Engine for CudaEngine {
    fn name(&self) -> String {
        format!("cuda:{}", self.gpu.ordinal)
    }

    fn staging(&self, len: usize) -> Result<Staging> {
        self.gpu.bind()?;
        let memory = pinned(&self.gpu, len)?;
        Ok(Staging {
            ptr: NonNull::new(memory.addr as *mut u8).expect("cuMemHostAlloc returned null"),
            len: memory.cap,
            _memory: StagingMemory::Pinned(memory),
        })
    }

    fn keep_staging(&self, bytes: u64) {
        set_pinned_limit(bytes as usize);
    }

    fn enter(&self) -> Result<()> {
        self.gpu.bind()
    }

    fn order_after(&self, stream: u64) -> Result<()> {
        let event = self.event()?;
        // SAFETY: `stream` is a live stream of this context given by the consumer (or 0); the
        // event may be destroyed once the wait is enqueued.
        unsafe {
            result::event::record(event.0 as sys::CUevent, stream as sys::CUstream)
                .map_err(|e| driver_error("cuEventRecord (consumer stream)", e))?;
            result::stream::wait_event(
                self.stream(),
                event.0 as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
        }
    }

    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller keeps `src` (page-locked staging) alive until a later fence passed,
        // and `dst` is device memory of this context.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, self.stream()) }
            .result()
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))
    }

    fn record(&self) -> Result<Fence> {
        let event = self.event()?;
        // SAFETY: both are live objects of this context.
        unsafe { result::event::record(event.0 as sys::CUevent, self.stream()) }
            .map_err(|e| driver_error("cuEventRecord", e))?;
        Ok(Fence::Event(event))
    }

    fn wait(&self, fence: Fence) -> Result<()> {
        let Fence::Event(event) = fence else {
            return Err(Error::device("fence from another engine"));
        };
        // SAFETY: a live event recorded on our stream.
        unsafe { result::event::synchronize(event.0 as sys::CUevent) }
            .map_err(|e| driver_error("copy to the device (cuEventSynchronize)", e))
    }
}

/// Device memory from `cuMemAlloc`, freed when dropped.
struct DeviceMemory {
    gpu: Arc<Gpu>,
    ptr: u64,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let ptr = self.ptr;
        let _ = self.gpu.borrow(|| {
            // SAFETY: allocated by `malloc_sync`, freed once.
            unsafe { result::free_sync(ptr) }.map_err(|e| driver_error("cuMemFree", e))
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
        let total: u64 = tensors.iter().map(|t| t.len.div_ceil(256) * 256).sum();
        // SAFETY: allocates `total` bytes of device memory in the bound context.
        let base = unsafe { result::malloc_sync(total.max(1) as usize) }
            .map_err(|e| driver_error("cuMemAlloc", e))?;
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
