//! Where tensors go when they do not stay in host memory: a copy [`Engine`] moves staged blocks to
//! destination memory that an [`Allocator`] hands out.
//!
//! - [`cuda`]: the GPU. Page-locked staging buffers, `cuMemcpyHtoDAsync` on a dedicated stream,
//!   events as fences. The driver (`libcuda.so.1`) is opened at run time with every entry point
//!   resolved at once, and never touched at import: a machine without a driver (or device) gets
//!   [`Error::Device`], never a panic.
//! - [`HostEngine`]: the same protocol into host memory, on a worker thread that plays the part of
//!   a copy stream. It runs the pipeline's staging, ordering and overlap logic on machines without
//!   a GPU (tests, CI), and is what `target="host"` selects.
//!
//! The pipeline (`pipeline/staged/`) reads each block into a [`Staging`] buffer, enqueues the
//! copies of the tensor pieces it holds, records a [`Fence`], and returns the buffer to the ring
//! once the fence passed; a segment's tensors are handed out after their last fence.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::memory::HostBuffer;
use crate::plan::TensorSlot;

#[cfg(feature = "cuda")]
pub mod cuda;

/// A point in an engine's copy queue: every copy enqueued before it is complete once
/// [`Engine::wait`] returns.
pub enum Fence {
    /// A [`HostEngine`] sequence number.
    Seq(u64),
    #[cfg(feature = "cuda")]
    Event(cuda::Event),
}

/// Moves bytes from staging buffers to destination memory, asynchronously and in order.
pub trait Engine: Send + Sync {
    /// "cuda:0", "host".
    fn name(&self) -> String;
    /// A staging buffer of at least `len` bytes, ready to be written (page-locked for a GPU).
    fn staging(&self, len: usize) -> Result<Staging>;
    /// The memory a staging buffer of `len` bytes really takes (page-locked memory is allocated in
    /// whole pages): what a ring of them counts.
    fn staging_size(&self, len: usize) -> usize {
        len
    }
    /// Staging memory a load may hold at once (its ring); engines that cache staging buffers
    /// between loads (page-locked memory is slow to allocate) keep at least this much.
    fn keep_staging(&self, _bytes: u64) {}
    /// Makes the engine usable from the calling thread (binds the CUDA context).
    fn enter(&self) -> Result<()> {
        Ok(())
    }
    /// Orders the copies enqueued from now on after the work already queued on the consumer's
    /// stream `stream` (a `CUstream` handle; 0 is the legacy default stream).
    fn order_after(&self, _stream: u64) -> Result<()> {
        Ok(())
    }
    /// Enqueues a copy of `len` bytes from `src` to destination address `dst`.
    ///
    /// # Safety
    /// `src` must stay valid and unchanged until a fence recorded after this call passed, and
    /// `[dst, dst + len)` must be destination memory nobody else writes meanwhile.
    #[allow(unsafe_code)]
    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// Enqueues a copy of `len` bytes from device address `src` to host memory `dst` (a staging
    /// buffer), in the same queue as [`Engine::copy`]: the way out, for writers.
    ///
    /// # Safety
    /// `[dst, dst + len)` must stay valid, and unread, until a fence recorded after this call
    /// passed, and `[src, src + len)` must be device memory of this engine that stays allocated
    /// (and unwritten) until then.
    #[allow(unsafe_code)]
    unsafe fn copy_to_host(&self, _dst: *mut u8, _src: u64, _len: usize) -> Result<()> {
        Err(Error::device(format!(
            "{}: copies to the host are not supported",
            self.name()
        )))
    }
    /// `memory` (a file's mapped pages) made a source of copies in place, with no copy out of
    /// the page cache: a [`Staging`] buffer over its bytes that is never written and gives the
    /// memory back when dropped (a GPU page-locks the pages where they are, read-only). An
    /// error when the engine cannot: the caller reads into [`Engine::staging`] instead.
    /// An engine into host memory copies from any memory: it takes the mapping as it is.
    fn lend(&self, memory: HostBuffer) -> Result<Staging> {
        Ok(Staging::over(memory))
    }
    /// Another engine into the same memory whose copies run in a queue of their own (a CUDA
    /// stream beside this one's; into host memory, another worker thread), sharing this one's
    /// staging memory: the further copy streams of a load (`copy_streams`). Its fences are
    /// waited for on it.
    fn lane(&self) -> Result<Arc<dyn Engine>> {
        Err(Error::device(format!(
            "{}: copies run in one queue only",
            self.name()
        )))
    }
    /// A fence after the copies enqueued so far.
    fn record(&self) -> Result<Fence>;
    /// Blocks until `fence` passed.
    fn wait(&self, fence: Fence) -> Result<()>;
}

/// Destination memory for one tensor: its address and whatever keeps it alive (a torch tensor
/// for the Python bindings, a device allocation for the CLI).
pub struct Destination {
    pub addr: u64,
    pub owner: Box<dyn Any + Send>,
}

/// Destinations for the tensors of one segment, and the stream whose work must finish before
/// that memory is written (see [`Engine::order_after`]); `None` when no ordering is needed.
pub struct Allocation {
    pub destinations: Vec<Destination>,
    pub stream: Option<u64>,
}

/// Hands out destination memory, one call per segment, from the pipeline's copy thread.
pub trait Allocator: Send {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation>;
}

/// What a staged load needs: the engine that copies and the allocator of destinations.
pub struct Target {
    pub engine: Arc<dyn Engine>,
    pub allocator: Box<dyn Allocator>,
}

/// Host memory that loads keep for the next load: freed pooled buffers (`host`) and page-locked
/// staging buffers (`pinned`), in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedMemory {
    pub host: u64,
    pub pinned: u64,
}

/// What is cached now.
pub fn cached_memory() -> CachedMemory {
    CachedMemory {
        host: crate::memory::pool_cached(),
        #[cfg(feature = "cuda")]
        pinned: cuda::pinned_cached() as u64,
        #[cfg(not(feature = "cuda"))]
        pinned: 0,
    }
}

/// Gives the cached memory back (to the OS, and to the CUDA driver) and keeps nothing more until
/// the next load; returns what was given back. For a process that loads once (an inference
/// server), this is the host memory loading needed and nothing after it does.
pub fn release_cached_memory() -> CachedMemory {
    CachedMemory {
        host: crate::memory::release_pool(),
        #[cfg(feature = "cuda")]
        pinned: cuda::release_pinned() as u64,
        #[cfg(not(feature = "cuda"))]
        pinned: 0,
    }
}

/// Owns a [`Staging`] buffer's memory; never read, dropped with it.
#[allow(dead_code)]
enum StagingMemory {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Pinned(cuda::Pinned),
    /// A file's mapped pages, page-locked in place for the device ([`Engine::lend`]).
    #[cfg(feature = "cuda")]
    Lent(cuda::Lent),
}

/// A host buffer that blocks are read into before they are copied out.
pub struct Staging {
    ptr: NonNull<u8>,
    len: usize,
    /// How long allocating it took, when the engine had to allocate page-locked memory for it
    /// (none of its cached buffers was free): what a load's `pinned_*` counters add up.
    pinned_in: Option<std::time::Duration>,
    /// Lent memory ([`Engine::lend`]): copied from where it is, never written; how long making
    /// it usable by the device took.
    lent_in: Option<std::time::Duration>,
    _memory: StagingMemory,
}

// SAFETY: plain memory; the pipeline gives each staging buffer to one reader, then one copier.
#[allow(unsafe_code)]
unsafe impl Send for Staging {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Staging {}

impl Staging {
    /// Pooled anonymous memory, faulted in.
    pub fn host(len: usize) -> Result<Staging> {
        let buffer = HostBuffer::alloc_populated(len.max(1), "staging buffer")?;
        Ok(Staging {
            ptr: NonNull::new(buffer.as_ptr()).expect("host buffer is not null"),
            len: buffer.len(),
            pinned_in: None,
            lent_in: None,
            _memory: StagingMemory::Host(buffer),
        })
    }

    /// Lent host memory: `buffer`'s bytes, copied from where they are (nothing to set up).
    fn over(buffer: HostBuffer) -> Staging {
        Staging {
            // A buffer of no bytes has a dangling, never-read address.
            ptr: NonNull::new(buffer.as_ptr()).unwrap_or(NonNull::dangling()),
            len: buffer.len(),
            pinned_in: None,
            lent_in: Some(std::time::Duration::ZERO),
            _memory: StagingMemory::Host(buffer),
        }
    }

    /// Whether this is lent memory ([`Engine::lend`]), and how long lending it took.
    pub fn lent_in(&self) -> Option<std::time::Duration> {
        self.lent_in
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether this buffer was page-locked for its load (not reused from the cache), and how
    /// long that took.
    pub fn pinned_in(&self) -> Option<std::time::Duration> {
        self.pinned_in
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its bytes, to read (a `fastload serve --hold` sends files from them).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for `self.len` bytes while `self` lives; writers need `&mut self`.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr(), self.len)
        }
    }

    /// The first `len` bytes, for a reader to fill.
    pub fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.len, "read larger than its staging buffer");
        assert!(self.lent_in.is_none(), "lent memory is never written");
        // SAFETY: `&mut self` is the only access to this memory, valid for `self.len` bytes.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len)
        }
    }

    /// Starts its bytes `lead` bytes in: a block read around the page cache
    /// ([`crate::source::Source::read_direct`]) fills the aligned span around it, whose first
    /// bytes come before the block's.
    pub fn start_at(&mut self, lead: usize) {
        assert!(lead <= self.len, "a block starting past its staging buffer");
        // SAFETY: `lead <= len`: inside (or one past) this buffer.
        #[allow(unsafe_code)]
        {
            self.ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(lead)) };
        }
        self.len -= lead;
    }
}

enum HostJob {
    Copy { dst: usize, src: usize, len: usize },
    Mark(u64),
}

struct Progress {
    passed: Mutex<u64>,
    cond: Condvar,
}

/// A copy engine into host memory: copies run in order on one worker thread, like a CUDA stream,
/// and fences are sequence numbers.
pub struct HostEngine {
    queue: Mutex<mpsc::Sender<HostJob>>,
    next: AtomicU64,
    progress: Arc<Progress>,
}

impl HostEngine {
    pub fn new() -> HostEngine {
        let (tx, rx) = mpsc::channel::<HostJob>();
        let progress = Arc::new(Progress {
            passed: Mutex::new(0),
            cond: Condvar::new(),
        });
        let worker = progress.clone();
        std::thread::Builder::new()
            .name("fastload-host-copy".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        HostJob::Copy { dst, src, len } => {
                            // SAFETY: `Engine::copy`'s contract: both ranges are valid and
                            // untouched by others until the next fence passed.
                            #[allow(unsafe_code)]
                            unsafe {
                                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len)
                            };
                        }
                        HostJob::Mark(seq) => {
                            *worker.passed.lock().unwrap_or_else(|e| e.into_inner()) = seq;
                            worker.cond.notify_all();
                        }
                    }
                }
            })
            .expect("spawning the host copy thread");
        HostEngine {
            queue: Mutex::new(tx),
            next: AtomicU64::new(0),
            progress,
        }
    }

    fn send(&self, job: HostJob) -> Result<()> {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .map_err(|_| Error::device("host copy thread is gone"))
    }
}

impl Default for HostEngine {
    fn default() -> Self {
        HostEngine::new()
    }
}

impl Engine for HostEngine {
    fn name(&self) -> String {
        "host".into()
    }

    fn staging(&self, len: usize) -> Result<Staging> {
        Staging::host(len)
    }

    #[allow(unsafe_code)]
    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.send(HostJob::Copy {
            dst: dst as usize,
            src: src as usize,
            len,
        })
    }

    #[allow(unsafe_code)]
    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // Host "device memory" is host memory: the same job, the other way.
        self.send(HostJob::Copy {
            dst: dst as usize,
            src: src as usize,
            len,
        })
    }

    fn lane(&self) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(HostEngine::new()))
    }

    fn record(&self) -> Result<Fence> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.send(HostJob::Mark(seq))?;
        Ok(Fence::Seq(seq))
    }

    // Irrefutable in builds without the `cuda` feature.
    #[allow(irrefutable_let_patterns)]
    fn wait(&self, fence: Fence) -> Result<()> {
        let Fence::Seq(seq) = fence else {
            return Err(Error::device("fence from another engine"));
        };
        let mut passed = self
            .progress
            .passed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while *passed < seq {
            passed = self
                .progress
                .cond
                .wait(passed)
                .unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }
}

/// Host memory destinations, one pooled buffer per tensor, faulted in up front: the Rust-side
/// allocator for [`HostEngine`] loads (tests, the CLI's `--device host`).
#[derive(Default)]
pub struct HostAllocator;

impl Allocator for HostAllocator {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        let destinations = tensors
            .iter()
            .map(|t| {
                let buffer = HostBuffer::alloc_populated(t.len as usize, "destination memory")?;
                Ok(Destination {
                    addr: buffer.as_ptr() as u64,
                    owner: Box::new(buffer),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Allocation {
            destinations,
            stream: None,
        })
    }
}

/// One allocation per tensor from `A`, whatever `A` does for a segment: each tensor then owns its
/// memory alone, so a tensor the consumer keeps holds no other tensor's memory (the Python
/// bindings' driver-allocated destinations; the CLI drops whole segments and allocates once each).
pub struct PerTensor<A>(pub A);

impl<A: Allocator> Allocator for PerTensor<A> {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        let mut destinations = Vec::with_capacity(tensors.len());
        let mut stream = None;
        for t in tensors {
            let one = self.0.allocate(std::slice::from_ref(t))?;
            stream = stream.or(one.stream);
            destinations.extend(one.destinations);
        }
        Ok(Allocation {
            destinations,
            stream,
        })
    }
}

impl Allocator for Box<dyn Allocator> {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        self.as_mut().allocate(tensors)
    }
}

/// The bytes of a destination made by [`HostAllocator`].
pub fn host_bytes(destination: &Destination) -> Option<&[u8]> {
    destination
        .owner
        .downcast_ref::<HostBuffer>()
        .map(|b| b.as_slice())
}

/// The engine for a target name: "host", "cuda" or "cuda:N".
pub fn engine(name: &str) -> Result<Arc<dyn Engine>> {
    if name == "host" {
        return Ok(Arc::new(HostEngine::new()));
    }
    let ordinal = parse_cuda(name)?;
    open_cuda(ordinal)
}

/// The ordinal of "cuda" (0) or "cuda:N".
pub fn parse_cuda(name: &str) -> Result<usize> {
    match name.strip_prefix("cuda") {
        Some("") => Ok(0),
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::option("device", format!("{name:?} is not cuda or cuda:N"))),
        None => Err(Error::option(
            "device",
            format!("{name:?} is not one of cpu, cuda, cuda:N"),
        )),
    }
}

/// A target whose destinations Rust allocates: [`HostAllocator`] for "host", driver allocations
/// for "cuda[:N]" (the CLI; the Python bindings allocate with torch instead).
pub fn rust_target(name: &str) -> Result<Target> {
    let engine = engine(name)?;
    if name == "host" {
        return Ok(Target {
            engine,
            allocator: Box::new(HostAllocator),
        });
    }
    #[cfg(feature = "cuda")]
    {
        Ok(Target {
            engine,
            allocator: Box::new(cuda::CudaAllocator::new(parse_cuda(name)?)?),
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        drop(engine);
        Err(Error::device("CUDA support was not built in"))
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Arc<dyn Engine>> {
    Ok(Arc::new(cuda::CudaEngine::new(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Arc<dyn Engine>> {
    Err(Error::device(
        "CUDA support was not built in (fastload was compiled without the `cuda` feature)",
    ))
}

/// Whether a CUDA driver can be loaded and initialised (probes it once; never panics).
pub fn cuda_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::driver_version().is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_engine_copies_in_order_and_fences() {
        let engine = HostEngine::new();
        let mut src = engine.staging(1 << 16).unwrap();
        for (i, b) in src.slice_mut(1 << 16).iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let mut dst = vec![0u8; 1 << 16];
        #[allow(unsafe_code)]
        unsafe {
            engine
                .copy(dst.as_mut_ptr() as u64, src.as_ptr(), 1 << 15)
                .unwrap();
            engine
                .copy(
                    dst.as_mut_ptr() as u64 + (1 << 15),
                    src.as_ptr().add(1 << 15),
                    1 << 15,
                )
                .unwrap();
        }
        let fence = engine.record().unwrap();
        engine.wait(fence).unwrap();
        assert_eq!(&dst[..], src.slice_mut(1 << 16));
    }

    #[test]
    fn parses_cuda_names() {
        assert_eq!(parse_cuda("cuda").unwrap(), 0);
        assert_eq!(parse_cuda("cuda:3").unwrap(), 3);
        assert!(parse_cuda("cuda:x").is_err());
        assert!(parse_cuda("mps").is_err());
    }
}
