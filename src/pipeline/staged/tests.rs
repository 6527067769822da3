//! The staged pipeline on the host engine and on engines and allocators built to be slow or
//! to fail, against checkpoints written here.

use super::*;
use crate::device::{host_bytes, Allocation, Allocator, Fence, HostAllocator, HostEngine};
use crate::error::Error;
use crate::options::LoadOptions;
use crate::pipeline::{Loaded, Memory};
use crate::plan::TensorSlot;
use std::io::Write;
use std::sync::atomic::AtomicU64;

/// A checkpoint of `sizes` U8 tensors whose bytes are a function of their position.
fn checkpoint(sizes: &[usize]) -> (tempfile::NamedTempFile, Vec<u8>) {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (i, &n) in sizes.iter().enumerate() {
        header.insert(
            format!("t{i:03}"),
            serde_json::json!({"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}),
        );
        at += n;
    }
    let json = serde_json::to_vec(&header).unwrap();
    let data: Vec<u8> = (0..at).map(|i| (i * 7 % 251) as u8).collect();
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&json).unwrap();
    f.write_all(&data).unwrap();
    (f, data)
}

type Named = Vec<(String, Vec<u8>)>;

/// A staged load of `file` through `engine`, into memory from `allocator`.
fn open(
    file: &tempfile::NamedTempFile,
    opts: &LoadOptions,
    engine: Arc<dyn Engine>,
    allocator: Box<dyn Allocator>,
) -> Loader {
    let uris = vec![file.path().to_string_lossy().into_owned()];
    super::super::open_staged(&uris, opts, Target { engine, allocator }).expect("open")
}

/// A staged load of `file` into host memory from `allocator`.
fn open_host(
    file: &tempfile::NamedTempFile,
    opts: &LoadOptions,
    allocator: Box<dyn Allocator>,
) -> Loader {
    open(file, opts, Arc::new(HostEngine::new()), allocator)
}

fn run(
    sizes: &[usize],
    opts: LoadOptions,
    engine: Arc<dyn Engine>,
    allocator: Box<dyn Allocator>,
) -> (Named, Vec<u8>, Loader) {
    let (file, data) = checkpoint(sizes);
    let mut loader = open(&file, &opts, engine, allocator);
    (collect(&mut loader), data, loader)
}

/// Every tensor a staged load delivers, by name.
fn collect(loader: &mut Loader) -> Named {
    let mut out = Vec::new();
    while let Some(seg) = loader.next_segment() {
        let seg = seg.expect("segment");
        let Memory::Placed(dest) = seg.memory else {
            panic!("staged load returned host memory");
        };
        for (t, d) in seg.tensors.iter().zip(&dest) {
            out.push((t.name.clone(), host_bytes(d).unwrap().to_vec()));
        }
    }
    out.sort();
    out
}

/// The error a load ends with, every tensor delivered before it checked against `want`: a load
/// of a file that changed under it fails, and never hands out wrong bytes first.
fn failure_after_right_bytes(loader: &mut Loader, want: &Named) -> String {
    while let Some(seg) = loader.next_segment() {
        let seg = match seg {
            Ok(seg) => seg,
            Err(e) => return e.to_string(),
        };
        let Memory::Placed(dest) = seg.memory else {
            panic!("staged load returned host memory");
        };
        for (t, d) in seg.tensors.iter().zip(&dest) {
            let (_, bytes) = want.iter().find(|(n, _)| *n == t.name).unwrap();
            assert_eq!(host_bytes(d).unwrap(), &bytes[..], "{}", t.name);
        }
    }
    panic!("the load did not fail");
}

fn expected(sizes: &[usize], data: &[u8]) -> Named {
    let mut at = 0;
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            at += n;
            (format!("t{i:03}"), data[at - n..at].to_vec())
        })
        .collect()
}

fn opts(block: u64, limit: u64) -> LoadOptions {
    LoadOptions {
        block_size: Some(block),
        memory_limit: Some(limit),
        concurrency: Some(4),
        ..Default::default()
    }
}

#[test]
fn copies_every_tensor_bitwise_with_pieces_and_empties() {
    // Tensors smaller than, equal to and many times a block; empty ones in between.
    let sizes = [3, 0, 4096, 70_000, 0, 1, 1 << 20, 5000, 12_345, 0];
    let (got, data, loader) = run(
        &sizes,
        opts(16 << 10, 1 << 20),
        Arc::new(HostEngine::new()),
        Box::new(HostAllocator),
    );
    assert_eq!(got, expected(&sizes, &data));
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(loader.stats().bytes_copied.load(Ordering::Relaxed), total);
    assert_eq!(loader.engine(), Some("host"));
}

/// A host engine whose copies are slow, so that reads run ahead of them.
struct SlowEngine {
    inner: HostEngine,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Engine for SlowEngine {
    fn name(&self) -> String {
        "slow".into()
    }
    fn staging(&self, len: usize) -> Result<Staging> {
        self.inner.staging(len)
    }
    #[allow(unsafe_code)]
    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.inner.copy(dst, src, len)
    }
    fn record(&self) -> Result<Fence> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        self.inner.record()
    }
    fn wait(&self, fence: Fence) -> Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(2));
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.inner.wait(fence)
    }
}

#[test]
fn reads_run_ahead_of_copies_within_the_ring() {
    let engine = Arc::new(SlowEngine {
        inner: HostEngine::new(),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
    });
    let sizes = [3 << 20, 100, 2 << 20];
    let (block, limit) = (128u64 << 10, 1u64 << 20);
    let (got, data, loader) = run(
        &sizes,
        opts(block, limit),
        engine.clone(),
        Box::new(HostAllocator),
    );
    assert_eq!(got, expected(&sizes, &data));
    // Host memory: never more than the ring, whatever the tensor sizes (5 MiB here).
    let peak = loader.stats().staging_peak.load(Ordering::Relaxed);
    assert!(peak <= limit, "staging peak {peak} over the {limit} limit");
    // Overlap: several blocks were waiting on copies while later ones were read.
    let most = engine.max_in_flight.load(Ordering::SeqCst);
    assert!(
        most >= 2,
        "copies never overlapped reads (max in flight {most})"
    );
    assert!(most as u64 <= limit / block);
}

#[test]
fn the_ring_is_sized_by_concurrency_not_by_the_memory_limit() {
    // A copy thread held up by a slow first allocation while 2 reads at a time run ahead:
    // the ring holds 2 x 2 blocks, whatever the limit lets it (64 MiB: 1024 blocks here).
    struct SlowFirst(bool);
    impl Allocator for SlowFirst {
        fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
            if !std::mem::replace(&mut self.0, true) {
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            HostAllocator.allocate(tensors)
        }
    }
    let sizes = [256usize << 10; 16];
    let block = 64u64 << 10;
    let o = LoadOptions {
        block_size: Some(block),
        memory_limit: Some(64 << 20),
        concurrency: Some(2),
        ..Default::default()
    };
    let (got, data, loader) = run(
        &sizes,
        o,
        Arc::new(HostEngine::new()),
        Box::new(SlowFirst(false)),
    );
    assert_eq!(got, expected(&sizes, &data));
    let peak = loader.stats().staging_peak.load(Ordering::Relaxed);
    assert!(
        peak <= 4 * block,
        "staging peak {peak} over 2 x concurrency blocks"
    );
    assert_eq!(ring_slots(64 << 20, block, 2), 4);
    assert_eq!(ring_slots(1 << 20, 512 << 10, 16), 2);
    assert_eq!(ring_slots(1 << 30, 8 << 20, 16), 32);
}

#[test]
fn phases_say_where_the_time_went() {
    // An allocator that takes 50 ms per segment and a copy engine whose every fence wait
    // takes 2 ms: the load's phases count at least that much in each (and the consumer,
    // which waits for every segment, waited too).
    struct Slow;
    impl Allocator for Slow {
        fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
            std::thread::sleep(Duration::from_millis(50));
            HostAllocator.allocate(tensors)
        }
    }
    let engine = Arc::new(SlowEngine {
        inner: HostEngine::new(),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
    });
    let sizes = [1usize << 20, 1 << 20];
    let (got, data, loader) = run(&sizes, opts(256 << 10, 4 << 20), engine, Box::new(Slow));
    assert_eq!(got, expected(&sizes, &data));
    let stats = loader.stats();
    let ms = |c: &AtomicU64| c.load(Ordering::Relaxed) / 1_000_000;
    assert!(ms(&stats.alloc_ns) >= 50, "alloc {}", ms(&stats.alloc_ns));
    // Eight blocks, each waited for at least 2 ms.
    assert!(
        ms(&stats.fence_wait_ns) >= 16,
        "fence {}",
        ms(&stats.fence_wait_ns)
    );
    assert!(ms(&stats.consumer_wait_ns) >= 50);
    assert!(stats.read_ns.load(Ordering::Relaxed) > 0);
    assert!(stats.staging_wait_ns.load(Ordering::Relaxed) > 0);
    assert!(stats.copy_idle_ns.load(Ordering::Relaxed) > 0);
    assert!(stats.copy_ns.load(Ordering::Relaxed) > 0);
}

struct FailingAllocator {
    after: usize,
}

impl Allocator for FailingAllocator {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        if self.after == 0 {
            return Err(Error::device("out of device memory (test)"));
        }
        self.after -= 1;
        HostAllocator.allocate(tensors)
    }
}

#[test]
fn allocator_failure_ends_the_load_with_its_error() {
    let (file, _) = checkpoint(&[1 << 20, 1 << 20, 1 << 20]);
    let mut loader = open_host(
        &file,
        &opts(64 << 10, 1 << 20),
        Box::new(FailingAllocator { after: 1 }),
    );
    let mut failed = None;
    while let Some(seg) = loader.next_segment() {
        if let Err(e) = seg {
            failed = Some(e.to_string());
        }
    }
    assert_eq!(failed.as_deref(), Some("out of device memory (test)"));
}

/// Host destinations that count the bytes alive (allocated and not yet dropped).
struct Counting {
    live: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

struct Counted {
    _buffer: crate::memory::HostBuffer,
    len: usize,
    live: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.live.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl Allocator for Counting {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
        let mut destinations = Vec::new();
        for t in tensors {
            let len = t.len as usize;
            let buffer = crate::memory::HostBuffer::alloc_populated(len, "test")?;
            let now = self.live.fetch_add(len, Ordering::SeqCst) + len;
            self.peak.fetch_max(now, Ordering::SeqCst);
            destinations.push(Destination {
                addr: buffer.as_ptr() as u64,
                owner: Box::new(Counted {
                    _buffer: buffer,
                    len,
                    live: self.live.clone(),
                }),
            });
        }
        Ok(Allocation {
            destinations,
            stream: None,
        })
    }
}

#[test]
fn destinations_of_undelivered_segments_stay_within_the_memory_limit() {
    // 32 tensors of 256 KiB, a 1 MiB limit (segments of 256 KiB), and a consumer much
    // slower than the reads that drops each segment: destination memory never holds more
    // than the limit. Before the budget, the whole 8 MiB piled up.
    let sizes = [256usize << 10; 32];
    let (file, data) = checkpoint(&sizes);
    let (live, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let limit = 1u64 << 20;
    let mut loader = open_host(
        &file,
        &opts(64 << 10, limit),
        Box::new(Counting {
            live: live.clone(),
            peak: peak.clone(),
        }),
    );
    let mut got = Vec::new();
    while let Some(seg) = loader.next_segment() {
        let seg = seg.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let Memory::Placed(dest) = seg.memory else {
            panic!()
        };
        for (t, d) in seg.tensors.iter().zip(&dest) {
            let Some(c) = d.owner.downcast_ref::<Counted>() else {
                panic!()
            };
            got.push((t.name.clone(), c._buffer.as_slice().to_vec()));
        }
    }
    got.sort();
    assert_eq!(got, expected(&sizes, &data));
    let peak = peak.load(Ordering::SeqCst) as u64;
    assert!(
        peak <= limit,
        "destination peak {peak} over the {limit} limit"
    );
    assert_eq!(live.load(Ordering::SeqCst), 0);
}

#[test]
fn a_consumer_that_keeps_every_segment_is_not_limited() {
    let sizes = [256usize << 10; 16];
    let (file, _) = checkpoint(&sizes);
    let mut loader = open_host(&file, &opts(64 << 10, 1 << 20), Box::new(HostAllocator));
    let kept: Vec<Loaded> = std::iter::from_fn(|| loader.next_segment())
        .map(|s| s.unwrap())
        .collect();
    assert_eq!(kept.iter().map(|s| s.tensors.len()).sum::<usize>(), 16);
}

#[test]
fn close_from_another_thread_ends_a_waiting_consumer() {
    // An allocator that never returns until released: the consumer waits in next_segment.
    struct Gate(Arc<std::sync::Barrier>);
    impl Allocator for Gate {
        fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
            self.0.wait();
            HostAllocator.allocate(tensors)
        }
    }
    let (file, _) = checkpoint(&[4096, 4096]);
    let gate = Arc::new(std::sync::Barrier::new(2));
    let mut loader = open_host(&file, &opts(4096, 1 << 20), Box::new(Gate(gate.clone())));
    let control = loader.control().clone();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        control.close();
    });
    let got = loader.next_segment();
    closer.join().unwrap();
    assert!(
        matches!(
            got,
            Some(Err(Error::Closed {
                delivered: 0,
                planned: 2
            }))
        ),
        "{:?}",
        got.map(|r| r.map(|_| ()))
    );
    assert!(loader.next_segment().is_none());
    gate.wait(); // lets the copy thread end
}

#[test]
fn dropping_the_loader_midway_returns_the_ring() {
    let (file, _) = checkpoint(&[4 << 20, 4 << 20]);
    let mut loader = open_host(&file, &opts(256 << 10, 1 << 20), Box::new(HostAllocator));
    let first = loader.next_segment().unwrap().unwrap();
    assert_eq!(first.tensors.len(), 1);
    drop(loader);
    // Nothing hangs and the copy threads end; the first tensor stays readable.
    let Memory::Placed(d) = first.memory else {
        panic!()
    };
    assert_eq!(host_bytes(&d[0]).unwrap().len(), 4 << 20);
}

#[test]
fn mmap_lends_the_files_pages_and_copies_bitwise() {
    let sizes = [3, 0, 4096, 70_000, 0, 1, 1 << 20, 5000, 12_345, 0];
    let opts = LoadOptions {
        method: Method::Mmap,
        ..opts(16 << 10, 1 << 20)
    };
    let (got, data, loader) = run(
        &sizes,
        opts,
        Arc::new(HostEngine::new()),
        Box::new(HostAllocator),
    );
    assert_eq!(got, expected(&sizes, &data));
    let stats = loader.stats();
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(stats.lent_bytes.load(Ordering::Relaxed), total);
    assert_eq!(stats.bytes_copied.load(Ordering::Relaxed), total);
    assert!(stats.lend_refused.get().is_none());
    assert_eq!(loader.method(), Method::Mmap);
    assert!(loader.config().method_reason.contains("mapped pages"));
}

/// A host engine that runs hooks with the number of each lend and each staging buffer asked of
/// it (from 1) first: a lend hook's error refuses that block. Its buffers are one byte off the
/// page grid when `misaligned`.
struct Hooked {
    inner: HostEngine,
    lends: AtomicUsize,
    stagings: AtomicUsize,
    misaligned: bool,
    on_lend: Box<dyn Fn(usize) -> Result<()> + Send + Sync>,
    on_staging: Box<dyn Fn(usize) + Send + Sync>,
}

impl Hooked {
    fn lending(hook: impl Fn(usize) -> Result<()> + Send + Sync + 'static) -> Arc<Hooked> {
        Hooked::new(false, Box::new(hook), Box::new(|_| {}))
    }

    fn staging(misaligned: bool, hook: impl Fn(usize) + Send + Sync + 'static) -> Arc<Hooked> {
        Hooked::new(misaligned, Box::new(|_| Ok(())), Box::new(hook))
    }

    /// One whose first staging buffer is asked for after the headers were read: the file at
    /// `path` is evicted from the page cache then (the header's read brought some of it in).
    fn evicting(path: &std::path::Path, misaligned: bool) -> Arc<Hooked> {
        let path = path.to_path_buf();
        // Blocks read side by side wait here until the file is out.
        let once = std::sync::Once::new();
        Hooked::staging(misaligned, move |_| {
            once.call_once(|| evict(&std::fs::File::open(&path).unwrap()));
        })
    }

    fn new(
        misaligned: bool,
        on_lend: Box<dyn Fn(usize) -> Result<()> + Send + Sync>,
        on_staging: Box<dyn Fn(usize) + Send + Sync>,
    ) -> Arc<Hooked> {
        Arc::new(Hooked {
            inner: HostEngine::new(),
            lends: AtomicUsize::new(0),
            stagings: AtomicUsize::new(0),
            misaligned,
            on_lend,
            on_staging,
        })
    }
}

impl Engine for Hooked {
    fn name(&self) -> String {
        "hooked".into()
    }
    fn staging(&self, len: usize) -> Result<Staging> {
        (self.on_staging)(self.stagings.fetch_add(1, Ordering::SeqCst) + 1);
        if !self.misaligned {
            return self.inner.staging(len);
        }
        let mut staging = self.inner.staging(len + 1)?;
        staging.start_at(1);
        Ok(staging)
    }
    fn lend(&self, memory: crate::memory::HostBuffer) -> Result<Staging> {
        (self.on_lend)(self.lends.fetch_add(1, Ordering::SeqCst) + 1)?;
        self.inner.lend(memory)
    }
    #[allow(unsafe_code)]
    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.inner.copy(dst, src, len)
    }
    fn record(&self) -> Result<Fence> {
        self.inner.record()
    }
    fn wait(&self, fence: Fence) -> Result<()> {
        self.inner.wait(fence)
    }
}

#[test]
fn a_block_that_cannot_be_lent_is_read_and_lending_stops() {
    let sizes = [70_000, 1 << 20, 5000, 300_000];
    let engine = Hooked::lending(|n| match n {
        1..=3 => Ok(()),
        _ => Err(Error::device("no more lending here")),
    });
    let opts = LoadOptions {
        method: Method::Mmap,
        concurrency: Some(1),
        ..opts(16 << 10, 1 << 20)
    };
    let (got, data, loader) = run(&sizes, opts, engine.clone(), Box::new(HostAllocator));
    assert_eq!(got, expected(&sizes, &data));
    let stats = loader.stats();
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    let lent = stats.lent_bytes.load(Ordering::Relaxed);
    assert!(lent > 0 && lent <= 3 * (16 << 10), "{lent}");
    assert_eq!(stats.bytes_copied.load(Ordering::Relaxed), total);
    let refused = stats.lend_refused.get().expect("a reason");
    assert!(refused.contains("no more lending here"), "{refused}");
    // The refusal stopped lending: the rest was read, not offered again.
    assert_eq!(engine.lends.load(Ordering::SeqCst), 4);
}

#[test]
fn a_file_cut_short_while_its_pages_are_lent_is_an_error_not_wrong_bytes() {
    // The last block's: no later block maps the file (which would see it changed) after it.
    let sizes = [70_000, 100_000, 5000, 300_000];
    let (file, data) = checkpoint(&sizes);
    let opts = LoadOptions {
        method: Method::Mmap,
        concurrency: Some(1),
        ..opts(16 << 10, 1 << 20)
    };
    let counting = Hooked::lending(|_| Ok(()));
    let mut loader = open(&file, &opts, counting.clone(), Box::new(HostAllocator));
    while loader.next_segment().is_some() {}
    let last = counting.lends.load(Ordering::SeqCst);
    let path = file.path().to_path_buf();
    let engine = Hooked::lending(move |n| {
        if n == last {
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(file.metadata().unwrap().len() - 1).unwrap();
        }
        Ok(())
    });
    let mut loader = open(&file, &opts, engine, Box::new(HostAllocator));
    let error = failure_after_right_bytes(&mut loader, &expected(&sizes, &data));
    assert!(error.contains("the file changed while loading"), "{error}");
}

#[test]
#[allow(unsafe_code)]
fn mmap_lends_pages_that_were_not_cached() {
    use std::os::unix::io::AsRawFd;
    // Pages out of the page cache: read in before they are lent (populated, as a mapped load
    // reads them), then copied as the file holds them.
    let sizes = [70_000, 1 << 20, 5000, 300_000];
    let (file, data) = checkpoint(&sizes);
    file.as_file().sync_all().unwrap();
    // SAFETY: an open descriptor and plain integers.
    let rc =
        unsafe { libc::posix_fadvise(file.as_file().as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
    let opts = LoadOptions {
        method: Method::Mmap,
        ..opts(64 << 10, 1 << 20)
    };
    let mut loader = open(
        &file,
        &opts,
        Arc::new(HostEngine::new()),
        Box::new(HostAllocator),
    );
    assert_eq!(collect(&mut loader), expected(&sizes, &data));
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(loader.stats().lent_bytes.load(Ordering::Relaxed), total);
}

#[test]
fn lent_blocks_leave_room_for_the_page_they_may_span_within_the_memory_limit() {
    // Two blocks of half the limit could not be lent within it: a block's pages span more than
    // its bytes when it starts inside a page.
    let sizes = [3, 1 << 20, 5000];
    let opts = LoadOptions {
        method: Method::Mmap,
        ..opts(512 << 10, 1 << 20)
    };
    let (got, data, loader) = run(
        &sizes,
        opts,
        Arc::new(HostEngine::new()),
        Box::new(HostAllocator),
    );
    assert_eq!(got, expected(&sizes, &data));
    assert_eq!(loader.config().block_size, (512 << 10) - span_spare());
    let peak = loader.stats().staging_peak.load(Ordering::Relaxed);
    assert!(peak + 2 * span_spare() <= 1 << 20, "{peak}");
}

/// Drops `file`'s pages from the page cache (written back first).
#[allow(unsafe_code)]
fn evict(file: &std::fs::File) {
    use std::os::unix::io::AsRawFd;
    file.sync_all().unwrap();
    // SAFETY: an open descriptor and plain integers.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
}

fn direct_opts(block: u64, limit: u64) -> LoadOptions {
    LoadOptions {
        method: Method::Direct,
        ..opts(block, limit)
    }
}

#[test]
fn direct_reads_uncached_blocks_around_the_page_cache_bitwise() {
    // Tensors that start and end inside pages, pieces of large ones, empty ones: every block's
    // aligned span is read, and the block is taken from `lead` bytes into it.
    let sizes = [3, 0, 4096, 70_000, 0, 1, 1 << 20, 5000, 12_345, 0, 777_777];
    let (file, data) = checkpoint(&sizes);
    let engine = Hooked::evicting(file.path(), false);
    let opts = direct_opts(64 << 10, 1 << 20);
    let mut loader = open(&file, &opts, engine, Box::new(HostAllocator));
    assert_eq!(collect(&mut loader), expected(&sizes, &data));
    let stats = loader.stats();
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(stats.bytes_copied.load(Ordering::Relaxed), total);
    assert!(
        stats.direct_refused.get().is_none(),
        "{:?}",
        stats.direct_refused
    );
    assert_eq!(stats.direct_bytes.load(Ordering::Relaxed), total);
    assert_eq!(loader.method(), Method::Direct);
    assert!(loader.config().method_reason.contains("O_DIRECT"));
    // Around the page cache: the reads left none of the file's pages there.
    let block = crate::memory::in_page_cache(file.as_file(), 512 << 10, 64 << 10);
    assert!(!block, "direct reads went through the page cache");
}

#[test]
fn direct_copies_cached_blocks_out_of_the_page_cache() {
    let sizes = [70_000, 1 << 20, 5000];
    let (file, data) = checkpoint(&sizes);
    let total: u64 = sizes.iter().map(|&n| n as u64).sum();
    let mut loader = open_host(
        &file,
        &direct_opts(64 << 10, 1 << 20),
        Box::new(HostAllocator),
    );
    assert_eq!(collect(&mut loader), expected(&sizes, &data));
    let direct = loader.stats().direct_bytes.load(Ordering::Relaxed);
    // A kernel that cannot say what is cached (before Linux 6.5) has every block read around it.
    let known = crate::memory::in_page_cache(file.as_file(), 0, 4096);
    assert_eq!(direct, if known { 0 } else { total });
}

#[test]
fn a_block_that_cannot_be_read_directly_stops_direct_reads() {
    // Buffers off the page grid cannot take a direct read: the first block says so, and that
    // block and the rest are read as method="read" reads them.
    let sizes = [70_000, 1 << 20, 5000, 300_000];
    let (file, data) = checkpoint(&sizes);
    let engine = Hooked::evicting(file.path(), true);
    let mut loader = open(
        &file,
        &direct_opts(64 << 10, 1 << 20),
        engine,
        Box::new(HostAllocator),
    );
    assert_eq!(collect(&mut loader), expected(&sizes, &data));
    let stats = loader.stats();
    assert_eq!(stats.direct_bytes.load(Ordering::Relaxed), 0);
    let refused = stats.direct_refused.get().expect("a reason");
    assert!(
        refused.contains("cannot take the aligned span"),
        "{refused}"
    );
    assert!(refused.contains("read through the page cache"), "{refused}");
}

#[test]
fn a_file_cut_short_before_a_direct_read_is_an_error_not_wrong_bytes() {
    let sizes = [70_000, 100_000, 5000, 300_000];
    let (file, data) = checkpoint(&sizes);
    let path = file.path().to_path_buf();
    let size = std::fs::metadata(&path).unwrap().len();
    // Before the third block's read: the file loses its last bytes and is evicted.
    let engine = Hooked::staging(false, move |n| {
        if n == 3 {
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(size - 1).unwrap();
            evict(&file);
        }
    });
    let opts = LoadOptions {
        concurrency: Some(1),
        ..direct_opts(16 << 10, 1 << 20)
    };
    let mut loader = open(&file, &opts, engine, Box::new(HostAllocator));
    let error = failure_after_right_bytes(&mut loader, &expected(&sizes, &data));
    assert!(error.contains("truncated"), "{error}");
}

/// Lane `id` of an engine of several copy queues: a host engine (a worker thread each) whose
/// fences carry the lane that recorded them, and which counts the blocks fenced on each lane.
struct Lane {
    id: u64,
    inner: HostEngine,
    /// Fences recorded per lane (one per block), and lanes made.
    fenced: Arc<[AtomicU64; 4]>,
    made: Arc<AtomicU64>,
}

impl Lane {
    fn first() -> Lane {
        Lane {
            id: 0,
            inner: HostEngine::new(),
            fenced: Arc::new(Default::default()),
            made: Arc::new(AtomicU64::new(1)),
        }
    }
}

impl Engine for Lane {
    fn name(&self) -> String {
        "lanes".into()
    }
    fn staging(&self, len: usize) -> Result<Staging> {
        self.inner.staging(len)
    }
    #[allow(unsafe_code)]
    unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.inner.copy(dst, src, len)
    }
    fn lane(&self) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(Lane {
            id: self.made.fetch_add(1, Ordering::SeqCst),
            inner: HostEngine::new(),
            fenced: self.fenced.clone(),
            made: self.made.clone(),
        }))
    }
    fn record(&self) -> Result<Fence> {
        self.fenced[self.id as usize].fetch_add(1, Ordering::SeqCst);
        match self.inner.record()? {
            Fence::Seq(seq) => Ok(Fence::Seq(self.id << 48 | seq)),
            #[allow(unreachable_patterns)]
            other => Ok(other),
        }
    }
    #[allow(irrefutable_let_patterns)]
    fn wait(&self, fence: Fence) -> Result<()> {
        let Fence::Seq(tagged) = fence else {
            return Err(Error::device("not a host fence"));
        };
        let lane = tagged >> 48;
        if lane != self.id {
            return Err(Error::device(format!(
                "a fence of lane {lane} waited for on lane {}",
                self.id
            )));
        }
        self.inner.wait(Fence::Seq(tagged & ((1 << 48) - 1)))
    }
}

#[test]
fn blocks_are_copied_on_every_copy_stream_in_turn() {
    let engine = Arc::new(Lane::first());
    let sizes = [3 << 20, 100, 0, 2 << 20, 70_000, 1];
    let opts = LoadOptions {
        copy_streams: Some(3),
        ..opts(128 << 10, 1 << 20)
    };
    let (got, data, loader) = run(&sizes, opts, engine.clone(), Box::new(HostAllocator));
    assert_eq!(got, expected(&sizes, &data));
    assert_eq!(loader.config().copy_streams, 3);
    assert_eq!(engine.made.load(Ordering::SeqCst), 3, "lanes made");
    // Block k on lane k mod 3 (and the empty tensor's segment, which copies nothing, too).
    let fenced: Vec<u64> = engine
        .fenced
        .iter()
        .map(|f| f.load(Ordering::SeqCst))
        .collect();
    let blocks: u64 = fenced.iter().sum();
    assert!(blocks >= 40, "{fenced:?}");
    assert_eq!(fenced[3], 0, "{fenced:?}");
    assert!(
        fenced[..3].iter().all(|&n| n.abs_diff(blocks / 3) <= 1),
        "{fenced:?}"
    );
}

#[test]
fn an_engine_of_one_queue_fails_a_load_of_several_before_it_reads() {
    let (file, _) = checkpoint(&[4096]);
    let uris = vec![file.path().to_string_lossy().into_owned()];
    let opts = LoadOptions {
        copy_streams: Some(2),
        ..opts(4096, 1 << 20)
    };
    let engine = Arc::new(SlowEngine {
        inner: HostEngine::new(),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
    });
    let target = Target {
        engine,
        allocator: Box::new(HostAllocator),
    };
    let Err(e) = super::super::open_staged(&uris, &opts, target) else {
        panic!("a load of two copy streams opened on an engine of one");
    };
    assert!(e.to_string().contains("one queue"), "{e}");
}

#[test]
fn host_engines_copy_on_as_many_threads_as_copy_streams() {
    let sizes = [1 << 20, 12_345, 3];
    for streams in [1, 2, 16] {
        let opts = LoadOptions {
            copy_streams: Some(streams),
            ..opts(64 << 10, 1 << 20)
        };
        let (got, data, loader) = run(
            &sizes,
            opts,
            Arc::new(HostEngine::new()),
            Box::new(HostAllocator),
        );
        assert_eq!(got, expected(&sizes, &data), "{streams} copy streams");
        assert_eq!(loader.config().copy_streams, streams);
    }
}
