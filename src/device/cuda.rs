//! The GPU engine, over the CUDA driver API with the driver loaded at run time.
//!
//! - Driver: `libcuda.so.1` opened on first use and every entry point resolved then
//!   ([`driver`]); the probe (`cuInit`) is cached per process. Nothing here runs at import, and
//!   nothing panics: a missing library or symbol is an error.
//! - Context: the device's primary context, the one the CUDA runtime (and so torch) uses, bound
//!   before every call that needs it (threads that run other code, such as torch's allocator,
//!   may have changed it since).
//! - Staging: page-locked, cacheable (`CU_MEMHOSTALLOC_PORTABLE`, not write-combined: object-store
//!   bodies are written into it by ordinary CPU copies) and kept in a process-wide pool, so a
//!   second load reuses the pinned memory of the first instead of pinning again (pinning runs at a
//!   few GB/s and would otherwise be paid per load).
//! - Lent pages: a file's mapped pages page-locked where they are, read-only (`lent`), for loads
//!   that copy from the page cache with no CPU copy (`method="mmap"`).
//! - Copies: `cuMemcpyHtoDAsync` (loads) and `cuMemcpyDtoHAsync` (saves) on one non-blocking
//!   stream per engine (a load of several copy streams has an engine per stream, its lanes); a
//!   fence is an event recorded after a block's copies.
//! - Fork: CUDA cannot be used in a child forked after it was initialised; every entry point
//!   checks the process id before calling the driver and gives a clear error, and the parent's
//!   page-locked buffers are neither counted nor freed there.

#![allow(unsafe_code)]

mod allocator;
mod driver;
mod lent;

pub use allocator::CudaAllocator;

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use driver::{Api, Status};

pub use lent::Lent;

use super::{Engine, Fence, Staging, StagingMemory};
use crate::error::{Error, Result};
use crate::memory::HostBuffer;

/// `Ok` for success, else the driver's name and text for `status`.
fn check(api: &Api, what: &str, status: Status) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    Err(Error::device(format!(
        "CUDA {what} failed: {}",
        api.describe(status)
    )))
}

const FORKED: &str = "CUDA was initialised before this process was forked; a forked child cannot \
                      use it (start workers with the 'spawn' method)";

/// The opened and initialised driver, and the process that initialised it.
struct Probe {
    api: &'static Api,
    version: i32,
    pid: u32,
}

/// The driver, loaded and initialised once per process. In a child forked after that, an error
/// before any driver call: the driver cannot be used there.
fn probe() -> Result<&'static Probe> {
    static PROBE: OnceLock<std::result::Result<Probe, String>> = OnceLock::new();
    let probe = PROBE
        .get_or_init(|| {
            let api = driver::api()?;
            // SAFETY: plain calls with valid out-pointers.
            let status = unsafe { (api.cuInit)(0) };
            if status == driver::CUDA_ERROR_NO_DEVICE {
                return Err(no_device(&format!(
                    "cuInit returned {}",
                    api.describe(status)
                )));
            }
            if status == driver::CUDA_ERROR_NOT_INITIALIZED {
                // What the driver answers in a child forked after its parent initialised CUDA
                // (torch, typically), where this process never did.
                return Err(format!(
                    "CUDA cannot be initialised here (cuInit returned {}); this is what a process \
                     forked after its parent initialised CUDA gets: start workers with the \
                     'spawn' method",
                    api.describe(status)
                ));
            }
            check(api, "initialisation (cuInit)", status).map_err(|e| e.to_string())?;
            let mut version = 0;
            // SAFETY: writes one int.
            check(api, "cuDriverGetVersion", unsafe {
                (api.cuDriverGetVersion)(&mut version)
            })
            .map_err(|e| e.to_string())?;
            Ok(Probe {
                api,
                version,
                pid: std::process::id(),
            })
        })
        .as_ref()
        .map_err(|e| Error::device(e.clone()))?;
    if probe.pid != std::process::id() {
        return Err(Error::device(FORKED));
    }
    Ok(probe)
}

/// What a machine with a driver but no usable device says, naming `CUDA_VISIBLE_DEVICES` when
/// it is set (it hides devices; `""` hides all of them).
fn no_device(detail: &str) -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!(
            "no CUDA device is visible: CUDA_VISIBLE_DEVICES={v:?} hides every device of this \
             machine from the driver ({detail})"
        ),
        Err(_) => format!(
            "no CUDA device is visible: the driver is installed but finds no device ({detail})"
        ),
    }
}

/// The driver's version (e.g. 12080), after loading and initialising it once per process.
pub fn driver_version() -> Result<i32> {
    Ok(probe()?.version)
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    let api = probe()?.api;
    let mut n = 0;
    // SAFETY: writes one int.
    check(api, "cuDeviceGetCount", unsafe {
        (api.cuDeviceGetCount)(&mut n)
    })?;
    Ok(n.max(0) as usize)
}

/// One device's primary context, retained for the life of the process.
struct Gpu {
    api: &'static Api,
    ordinal: usize,
    ctx: usize,
    pid: u32,
}

impl Gpu {
    fn get(ordinal: usize) -> Result<Arc<Gpu>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let count = device_count()?;
        if count == 0 {
            return Err(Error::device(no_device("cuDeviceGetCount returned 0")));
        }
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
            return Ok(gpu.clone());
        }
        let api = probe()?.api;
        let mut dev = 0;
        // SAFETY: writes one device handle.
        check(api, "cuDeviceGet", unsafe {
            (api.cuDeviceGet)(&mut dev, ordinal as i32)
        })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: retains (creating if needed) the device's primary context; never released,
        // like the runtime does.
        check(api, "cuDevicePrimaryCtxRetain", unsafe {
            (api.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
        })?;
        let gpu = Arc::new(Gpu {
            api,
            ordinal,
            ctx: ctx as usize,
            pid: std::process::id(),
        });
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    /// Whether this is the process that retained the context (not a child forked since).
    fn here(&self) -> bool {
        self.pid == std::process::id()
    }

    /// Makes this context current on the calling thread.
    fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        check(self.api, "cuCtxSetCurrent", unsafe {
            (self.api.cuCtxSetCurrent)(self.ctx as driver::Context)
        })
    }

    fn current(&self) -> Result<driver::Context> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes one context handle (null when none is current).
        check(self.api, "cuCtxGetCurrent", unsafe {
            (self.api.cuCtxGetCurrent)(&mut ctx)
        })?;
        Ok(ctx)
    }

    /// Runs `f` with this context bound, then puts back the calling thread's own (or none): the
    /// thread may be a consumer's, whose CUDA runtime (torch) takes its current device from it.
    fn borrow<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let previous = self.current()?;
        if previous as usize == self.ctx {
            return f();
        }
        self.bind()?;
        let out = f();
        // SAFETY: the context that was current here a moment ago (or none).
        check(self.api, "cuCtxSetCurrent", unsafe {
            (self.api.cuCtxSetCurrent)(previous)
        })?;
        out
    }
}

/// A CUDA event of one context, destroyed (in that context, from any thread) when dropped.
pub struct Event {
    raw: usize,
    gpu: Arc<Gpu>,
}

impl Event {
    fn raw(&self) -> driver::Event {
        self.raw as driver::Event
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if !self.gpu.here() {
            return; // a forked child cannot call the driver
        }
        let (api, event) = (self.gpu.api, self.raw());
        let _ = self.gpu.borrow(|| {
            // SAFETY: created by `CudaEngine::event`, destroyed once.
            check(api, "cuEventDestroy", unsafe {
                (api.cuEventDestroy_v2)(event)
            })
        });
    }
}

/// A page-locked buffer nobody uses, kept for the next load.
struct Cached {
    addr: usize,
    cap: usize,
    gpu: Arc<Gpu>,
}

/// Page-locked buffers kept between loads. Everything is counted in what is really pinned (a
/// buffer's whole capacity), and a buffer is only reused for its own size: the ring then pins
/// exactly what it counts. Buffers of another size are evicted as soon as a load needs room
/// (a load uses one size), so a change of block size costs one ring's worth of allocations, not
/// a `cuMemHostAlloc` + `cuMemFreeHost` (slow, and synchronising the device) per block.
struct PinnedPool {
    free: Vec<Cached>,
    cached: usize,
    limit: usize,
    /// The process whose thread is in `cuMemHostAlloc` now, if any (see [`pinned`]).
    pinning: Option<u32>,
}

impl PinnedPool {
    /// Removes cached buffers of other sizes than `cap` (oldest first) until `cap` more bytes fit
    /// the limit, or all of them when `all`; returns them for freeing outside the lock.
    fn evict(&mut self, cap: usize, all: bool) -> Vec<Cached> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.free.len() && (all || self.cached + cap > self.limit) {
            if self.free[i].cap != cap {
                let c = self.free.remove(i);
                self.cached -= c.cap;
                out.push(c);
            } else {
                i += 1;
            }
        }
        out
    }
}

static PINNED: Mutex<PinnedPool> = Mutex::new(PinnedPool {
    free: Vec::new(),
    cached: 0,
    limit: 0,
    pinning: None,
});

/// Signalled when a buffer goes back to the pool or a thread is done pinning: what a thread
/// waiting in [`pinned`] for one or the other waits on.
static RETURNED: Condvar = Condvar::new();

fn pool() -> MutexGuard<'static, PinnedPool> {
    PINNED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets how many bytes of page-locked staging memory stay cached between loads (at least what
/// an earlier load of this process asked for, until [`release_pinned`]).
pub fn set_pinned_limit(bytes: usize) {
    let mut pool = pool();
    pool.limit = pool.limit.max(bytes);
}

/// Bytes of page-locked memory cached for the next load (none in a forked child: the parent's
/// buffers are not usable there).
pub fn pinned_cached() -> usize {
    let pool = pool();
    pool.free
        .iter()
        .filter(|c| c.gpu.here())
        .map(|c| c.cap)
        .sum()
}

/// Frees every cached page-locked buffer and stops caching until the next GPU load: buffers in
/// use are freed when their load is done with them. Returns the bytes freed (none in a forked
/// child, which cannot call the driver: the parent's buffers are forgotten there).
pub fn release_pinned() -> usize {
    let free = {
        let mut pool = pool();
        pool.limit = 0;
        pool.cached = 0;
        std::mem::take(&mut pool.free)
    };
    free_all(free)
}

/// Gives cached buffers back to the driver; returns the bytes given back.
fn free_all(buffers: Vec<Cached>) -> usize {
    buffers
        .into_iter()
        .map(|c| {
            if free_pinned(c.addr, &c.gpu) {
                c.cap
            } else {
                0
            }
        })
        .sum()
}

/// Gives page-locked memory back to the driver, in the context that allocated it (from any
/// thread); whether it did. In a child forked after CUDA was initialised the driver cannot be
/// called: the memory is left as it is.
fn free_pinned(addr: usize, gpu: &Gpu) -> bool {
    if !gpu.here() {
        return false;
    }
    let api = gpu.api;
    gpu.borrow(|| {
        // SAFETY: allocated by `cuMemHostAlloc` in this process, no longer referenced.
        check(api, "cuMemFreeHost", unsafe {
            (api.cuMemFreeHost)(addr as *mut c_void)
        })
    })
    .is_ok()
}

/// Page-locked host memory from the pool; returns there when dropped.
pub struct Pinned {
    addr: usize,
    cap: usize,
    gpu: Arc<Gpu>,
    /// How long `cuMemHostAlloc` took, when this buffer was allocated for its load rather than
    /// taken from the pool.
    pinned_in: Option<std::time::Duration>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let (evicted, keep) = {
            let mut pool = pool();
            let evicted = pool.evict(self.cap, false);
            let keep = pool.cached + self.cap <= pool.limit;
            if keep {
                pool.cached += self.cap;
                pool.free.push(Cached {
                    addr: self.addr,
                    cap: self.cap,
                    gpu: self.gpu.clone(),
                });
            }
            (evicted, keep)
        };
        if keep {
            RETURNED.notify_all();
        }
        free_all(evicted);
        if !keep {
            free_pinned(self.addr, &self.gpu);
        }
    }
}

/// What a staging buffer of `len` bytes really pins: whole pages.
fn pinned_size(len: usize) -> usize {
    const PAGE: usize = 4096;
    len.max(1).div_ceil(PAGE) * PAGE
}

/// `len` bytes (rounded up to pages) of page-locked memory; `gpu`'s context is bound.
///
/// One thread of the process pins at a time; the others wait for a buffer of their size to come
/// back to the pool, or for their turn to pin, whichever comes first. The driver pins one
/// allocation at a time anyway (`cuMemHostAlloc` runs at a few GB/s), so the wait costs no
/// pinning speed, and it lets a first load grow its ring only as fast as its reads use it: a read
/// that waited takes the buffer an earlier block's copy just gave back instead of queueing a new
/// allocation in the driver behind every other read's (which made the first load of a process run
/// at the pinning rate until the whole ring was pinned).
fn pinned(gpu: &Arc<Gpu>, len: usize) -> Result<Pinned> {
    let cap = pinned_size(len);
    let me = std::process::id();
    let mut pool = pool();
    loop {
        if let Some(i) = pool.free.iter().rposition(|c| c.cap == cap) {
            let c = pool.free.swap_remove(i);
            pool.cached -= c.cap;
            return Ok(Pinned {
                addr: c.addr,
                cap: c.cap,
                gpu: c.gpu,
                pinned_in: None,
            });
        }
        // (A pin of the parent's, in a child forked meanwhile, never ends here.)
        if pool.pinning != Some(me) {
            break;
        }
        pool = RETURNED.wait(pool).unwrap_or_else(|e| e.into_inner());
    }
    pool.pinning = Some(me);
    // None of this size: the cached ones are another load's, and would only add to what this
    // one pins.
    let evicted = pool.evict(cap, true);
    drop(pool);
    let _turn = PinTurn;
    free_all(evicted);
    let api = gpu.api;
    let mut ptr = std::ptr::null_mut();
    let started = std::time::Instant::now();
    // SAFETY: allocates `cap` bytes of page-locked memory, usable from every context.
    check(api, "cuMemHostAlloc (page-locked staging memory)", unsafe {
        (api.cuMemHostAlloc)(&mut ptr, cap, driver::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(Pinned {
        addr: ptr as usize,
        cap,
        gpu: gpu.clone(),
        pinned_in: Some(started.elapsed()),
    })
}

/// A thread's turn to pin ([`pinned`]); ends when dropped, on success or error.
struct PinTurn;

impl Drop for PinTurn {
    fn drop(&mut self) {
        pool().pinning = None;
        RETURNED.notify_all();
    }
}

/// Copies into memory of one CUDA device, on a dedicated stream.
///
/// Every call binds the engine's context first: the copy thread also runs the allocator (torch,
/// in the Python bindings), which may leave another context current on it.
pub struct CudaEngine {
    gpu: Arc<Gpu>,
    stream: usize,
}

impl CudaEngine {
    pub fn new(ordinal: usize) -> Result<CudaEngine> {
        let gpu = Gpu::get(ordinal)?;
        let api = gpu.api;
        let mut stream = std::ptr::null_mut();
        // Called on the consumer's thread: its current context stays as it was.
        gpu.borrow(|| {
            // SAFETY: writes one stream handle.
            check(api, "cuStreamCreate", unsafe {
                (api.cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING)
            })
        })?;
        Ok(CudaEngine {
            gpu,
            stream: stream as usize,
        })
    }

    fn stream(&self) -> driver::Stream {
        self.stream as driver::Stream
    }

    /// A new event of this context, which is bound.
    fn event(&self) -> Result<Event> {
        // Blocking sync: the completion thread sleeps in cuEventSynchronize instead of spinning
        // on a core that the reads need; a wake-up costs microseconds against a block's copy
        // time of hundreds.
        let flags = driver::CU_EVENT_DISABLE_TIMING | driver::CU_EVENT_BLOCKING_SYNC;
        let api = self.gpu.api;
        let mut event = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        check(api, "cuEventCreate", unsafe {
            (api.cuEventCreate)(&mut event, flags)
        })?;
        Ok(Event {
            raw: event as usize,
            gpu: self.gpu.clone(),
        })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        if !self.gpu.here() {
            return;
        }
        let (api, stream) = (self.gpu.api, self.stream());
        // The last owner may be the consumer's thread: borrow the context.
        let _ = self.gpu.borrow(|| {
            // SAFETY: our stream; cuStreamDestroy lets queued work finish first.
            check(api, "cuStreamDestroy", unsafe {
                (api.cuStreamDestroy_v2)(stream)
            })
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
            pinned_in: memory.pinned_in,
            lent_in: None,
            _memory: StagingMemory::Pinned(memory),
        })
    }

    fn staging_size(&self, len: usize) -> usize {
        pinned_size(len)
    }

    fn keep_staging(&self, bytes: u64) {
        set_pinned_limit(bytes as usize);
    }

    fn lend(&self, memory: HostBuffer) -> Result<Staging> {
        self.gpu.bind()?;
        lent::lend(&self.gpu, memory)
    }

    fn enter(&self) -> Result<()> {
        self.gpu.bind()
    }

    fn order_after(&self, stream: u64) -> Result<()> {
        self.gpu.bind()?;
        let api = self.gpu.api;
        let event = self.event()?;
        // SAFETY: `stream` is a live stream of this context given by the consumer (or 0); the
        // event may be destroyed once the wait is enqueued.
        check(api, "cuEventRecord (consumer stream)", unsafe {
            (api.cuEventRecord)(event.raw(), stream as driver::Stream)
        })?;
        // SAFETY: our stream and a recorded event of its context.
        check(api, "cuStreamWaitEvent", unsafe {
            (api.cuStreamWaitEvent)(self.stream(), event.raw(), driver::CU_EVENT_WAIT_DEFAULT)
        })
    }

    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.gpu.bind()?;
        let api = self.gpu.api;
        // SAFETY: the caller keeps `src` (page-locked staging) alive until a later fence passed,
        // and `dst` is device memory of this context.
        check(api, "cuMemcpyHtoDAsync", unsafe {
            (api.cuMemcpyHtoDAsync_v2)(dst, src as *const c_void, len, self.stream())
        })
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        self.gpu.bind()?;
        let api = self.gpu.api;
        // SAFETY: the caller keeps `dst` (page-locked staging) alive and unread until a later
        // fence passed, and `src` is device memory of this context that stays allocated.
        check(api, "cuMemcpyDtoHAsync", unsafe {
            (api.cuMemcpyDtoHAsync_v2)(dst as *mut c_void, src, len, self.stream())
        })
    }

    fn lane(&self) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(CudaEngine::new(self.gpu.ordinal)?))
    }

    fn record(&self) -> Result<Fence> {
        self.gpu.bind()?;
        let api = self.gpu.api;
        let event = self.event()?;
        // SAFETY: both are live objects of this context.
        check(api, "cuEventRecord", unsafe {
            (api.cuEventRecord)(event.raw(), self.stream())
        })?;
        Ok(Fence::Event(event))
    }

    fn wait(&self, fence: Fence) -> Result<()> {
        let Fence::Event(event) = fence else {
            return Err(Error::device("fence from another engine"));
        };
        self.gpu.bind()?;
        let api = self.gpu.api;
        // SAFETY: a live event recorded on our stream.
        check(api, "copy to the device (cuEventSynchronize)", unsafe {
            (api.cuEventSynchronize)(event.raw())
        })
    }
}
