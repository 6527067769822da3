//! What the hardware allows, measured in the same run and on the same files as `fastload bench`,
//! so that fastload's rate can be printed beside it:
//!
//! - `storage_direct`: the files read with `O_DIRECT` (page cache bypassed) by as many threads as
//!   the loader has reads in flight, in the loader's block size;
//! - `storage_buffered`: the files, evicted, read through the page cache by several threads on
//!   contiguous regions (the kernel's readahead runs ahead of each); on some virtual disks this
//!   beats `O_DIRECT`, so the cold limit is the faster of the two;
//! - `page_cache`: the warm files copied out of the page cache with `pread` into reused buffers;
//! - `mapped_touch`: the warm files mapped and one byte of every page read (what a mapped load from
//!   memory does, copying nothing);
//! - `ranged_get`: objects read with the same client, concurrency and block size, bytes discarded;
//! - `host_to_device`: page-locked buffer to device memory copies through the copy engine.
//!
//! Each is one pass (the whole checkpoint, or a bounded number of copies); a limit that cannot be
//! measured here is reported with `gb_per_s: null` and the reason.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use serde::Serialize;

use crate::device::Target;
use crate::format::Dtype;
use crate::options::Size;
use crate::plan::TensorSlot;
use crate::source::Shard;

/// Buffered readers of cold files: enough for readahead to keep the storage busy.
pub(super) const COLD_READERS: usize = 8;

/// Buffered readers of warm files: a copy out of the page cache is CPU work, so one per core (at
/// most 8); more contend for the cores and understate the rate.
pub(super) fn warm_readers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}
/// `O_DIRECT` needs buffers, offsets and lengths aligned to the device's logical block size; 4 KiB
/// covers every common one.
const ALIGN: usize = 4096;

/// A read of one file: its index, the offset and the length.
type Job = (usize, u64, usize);

/// One measured limit.
#[derive(Serialize, Clone, Debug)]
pub(super) struct Limit {
    /// `None`: not measurable here (`what` says why).
    pub gb_per_s: Option<f64>,
    /// How it was measured, or why it could not be.
    pub what: String,
    /// Bytes the measurement moved (untimed warm-up included).
    pub bytes: u64,
}

impl Limit {
    fn rate(bytes: u64, started: Instant, what: String) -> Limit {
        let s = started.elapsed().as_secs_f64();
        Limit {
            gb_per_s: Some(if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }),
            what,
            bytes,
        }
    }

    /// The best of `times` measurements (at least one): a single pass on a shared machine reads
    /// low as often as not, so a limit is measured as many times as the runs it is compared with.
    /// `bytes` counts every measurement's bytes; a measurement that cannot be made ends it.
    pub(super) fn try_best_of<E>(
        times: u32,
        mut measure: impl FnMut() -> std::result::Result<Limit, E>,
    ) -> std::result::Result<Limit, E> {
        let mut best = measure()?;
        let mut bytes = best.bytes;
        for _ in 1..times {
            if best.gb_per_s.is_none() {
                break;
            }
            let next = measure()?;
            bytes += next.bytes;
            if next.gb_per_s > best.gb_per_s {
                best = next;
            }
        }
        best.bytes = bytes;
        if times > 1 && best.gb_per_s.is_some() {
            best.what = format!("{}; best of {times}", best.what);
        }
        Ok(best)
    }

    /// [`Limit::try_best_of`] for measurements that report failure in the limit itself.
    pub(super) fn best_of(times: u32, mut measure: impl FnMut() -> Limit) -> Limit {
        match Limit::try_best_of(times, || Ok::<_, std::convert::Infallible>(measure())) {
            Ok(limit) => limit,
            Err(never) => match never {},
        }
    }

    fn unmeasurable(what: String) -> Limit {
        Limit {
            gb_per_s: None,
            what,
            bytes: 0,
        }
    }
}

/// Runs `threads` workers that take (file, offset, len) jobs off one list in order and pass them
/// to `read`, each with its own buffer; the bytes read.
fn parallel<F>(jobs: &[Job], threads: usize, read: F) -> io::Result<u64>
where
    F: Fn(usize, u64, &mut [u8]) -> io::Result<()> + Sync,
{
    let next = AtomicUsize::new(0);
    let biggest = jobs.iter().map(|j| j.2).max().unwrap_or(0);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                scope.spawn(|| -> io::Result<u64> {
                    let mut buf = AlignedBuf::new(biggest);
                    let mut done = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(file, offset, len)) = jobs.get(i) else {
                            return Ok(done);
                        };
                        read(file, offset, &mut buf.as_mut()[..len])?;
                        done += len as u64;
                    }
                })
            })
            .collect();
        workers.into_iter().try_fold(0, |sum, w| {
            Ok(sum + w.join().expect("a limit reader panicked")?)
        })
    })
}

/// A zeroed, `ALIGN`-aligned buffer (what `O_DIRECT` reads need).
struct AlignedBuf {
    data: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let data = vec![0u8; len + ALIGN];
        let start = data.as_ptr().align_offset(ALIGN);
        AlignedBuf { data, start, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.data[self.start..self.start + self.len]
    }
}

/// Jobs of `block` bytes covering every file (the last one of a file rounded up to `ALIGN`, so
/// that `O_DIRECT` accepts it; a read past the end returns short).
fn blocks(sizes: &[u64], block: usize) -> Vec<Job> {
    let mut jobs = Vec::new();
    for (file, &size) in sizes.iter().enumerate() {
        let mut offset = 0;
        while offset < size {
            let len = (size - offset).min(block as u64) as usize;
            jobs.push((file, offset, len.div_ceil(ALIGN) * ALIGN));
            offset += block as u64;
        }
    }
    jobs
}

/// Reads up to `dst.len()` bytes at `offset`, stopping at the end of the file.
fn read_upto(file: &File, offset: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        match file.read_at(&mut dst[done..], offset + done as u64) {
            Ok(0) => return Ok(()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn sizes(files: &[PathBuf]) -> io::Result<Vec<u64>> {
    files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()))
        .collect()
}

fn total(sizes: &[u64]) -> u64 {
    sizes.iter().sum()
}

/// The storage read with `O_DIRECT`: `threads` reads of `block` bytes in flight.
pub(super) fn storage_direct(files: &[PathBuf], threads: usize, block: u64) -> Limit {
    let block = (block as usize).div_ceil(ALIGN) * ALIGN;
    let opened: io::Result<Vec<File>> = files
        .iter()
        .map(|f| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(f)
        })
        .collect();
    let what = format!(
        "O_DIRECT reads, {threads} in flight x {}",
        Size(block as u64)
    );
    let (files, sizes) = match opened.and_then(|o| Ok((o, sizes(files)?))) {
        Ok(v) => v,
        Err(e) => return Limit::unmeasurable(format!("not measurable here: O_DIRECT open: {e}")),
    };
    let jobs = blocks(&sizes, block);
    let started = Instant::now();
    match parallel(&jobs, threads, |i, offset, dst| {
        read_upto(&files[i], offset, dst)
    }) {
        Ok(_) => Limit::rate(total(&sizes), started, what),
        Err(e) => Limit::unmeasurable(format!("not measurable here: O_DIRECT read: {e}")),
    }
}

/// The files read through the page cache by `readers` threads, each on a contiguous
/// region of about an equal share, in `block`-sized `pread`s into a reused buffer. Cold when the
/// files were evicted, a page-cache copy rate when they are resident.
pub(super) fn buffered(files: &[PathBuf], readers: usize, block: u64, what: &str) -> Limit {
    let read = || -> io::Result<(u64, Vec<Job>, Vec<File>)> {
        let sizes = sizes(files)?;
        let opened = files
            .iter()
            .map(File::open)
            .collect::<io::Result<Vec<_>>>()?;
        // Each reader's region is a run of consecutive jobs, about an equal number each.
        let jobs = blocks(&sizes, block as usize);
        Ok((total(&sizes), jobs, opened))
    };
    let (bytes, jobs, opened) = match read() {
        Ok(v) => v,
        Err(e) => return Limit::unmeasurable(format!("not measurable here: {e}")),
    };
    let readers = readers.min(jobs.len()).max(1);
    let n = jobs.len();
    let regions: Vec<&[Job]> = (0..readers)
        .map(|r| &jobs[r * n / readers..(r + 1) * n / readers])
        .collect();
    let started = Instant::now();
    let result = std::thread::scope(|scope| {
        let workers: Vec<_> = regions
            .iter()
            .map(|region| {
                let opened = &opened;
                scope.spawn(move || -> io::Result<()> {
                    let mut buf = vec![0u8; block as usize + ALIGN];
                    for &(i, offset, len) in region.iter() {
                        read_upto(&opened[i], offset, &mut buf[..len])?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a limit reader panicked"))
    });
    let readers = super::plural(regions.len(), "reader");
    let what = format!("{what}, {readers} x {} pread", Size(block));
    match result {
        Ok(()) => Limit::rate(bytes, started, what),
        Err(e) => Limit::unmeasurable(format!("not measurable here: {e}")),
    }
}

/// A read-only shared mapping of a whole file, unmapped on drop.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and only read through; the pointer is not tied to a thread.
#[allow(unsafe_code)]
unsafe impl Sync for Mapping {}

impl Mapping {
    #[allow(unsafe_code)]
    fn new(file: &File, len: usize) -> io::Result<Mapping> {
        use std::os::unix::io::AsRawFd;
        // SAFETY: a fresh read-only mapping of an open descriptor of `len` (> 0) bytes; the kernel
        // picks the address; nothing else refers to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { addr, len })
    }

    /// One byte of every page in `pages` (page numbers of the mapping), summed.
    #[allow(unsafe_code)]
    fn touch(&self, pages: std::ops::Range<usize>) -> u64 {
        let mut sum = 0u64;
        for page in pages {
            // SAFETY: `page * PAGE < len`: the byte lies in the mapping, which lives as long as
            // `self`; volatile, so the read is not elided.
            let byte =
                unsafe { std::ptr::read_volatile((self.addr as *const u8).add(page * PAGE)) };
            sum = sum.wrapping_add(u64::from(byte));
        }
        sum
    }
}

impl Drop for Mapping {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no reference into it outlives `self`.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// The page size the touches stride by, as the bench's consumer reads.
const PAGE: usize = 4096;

/// The warm files mapped and one byte of every 4 KiB page read, by `readers` threads on
/// contiguous regions of about an equal share, mapping and unmapping inside the clock: the work a
/// mapped load from the page cache cannot avoid (it copies nothing).
pub(super) fn mapped_touch(files: &[PathBuf], readers: usize) -> Limit {
    let open = || -> io::Result<(Vec<File>, Vec<u64>)> {
        let opened = files.iter().map(File::open).collect::<io::Result<_>>()?;
        Ok((opened, sizes(files)?))
    };
    let (opened, sizes) = match open() {
        Ok(v) => v,
        Err(e) => return Limit::unmeasurable(format!("not measurable here: {e}")),
    };
    // Reader r touches global pages r*n/readers.. of the files laid end to end.
    let counts: Vec<usize> = sizes.iter().map(|&s| (s as usize).div_ceil(PAGE)).collect();
    let n: usize = counts.iter().sum();
    // A thread per 32 MiB at most: on small files starting threads would cost more than the
    // touches, and the limit would read low.
    let readers = readers.min(n.div_ceil(8192)).max(1);
    let started = Instant::now();
    let mapped: io::Result<Vec<Option<Mapping>>> = opened
        .iter()
        .zip(&sizes)
        .map(|(f, &len)| (len > 0).then(|| Mapping::new(f, len as usize)).transpose())
        .collect();
    let mapped = match mapped {
        Ok(m) => m,
        Err(e) => return Limit::unmeasurable(format!("not measurable here: mmap: {e}")),
    };
    let touch = |(from, to): (usize, usize)| {
        let (mut sum, mut first) = (0u64, 0usize);
        for (m, &count) in mapped.iter().zip(&counts) {
            let (lo, hi) = (from.max(first), to.min(first + count));
            if let (Some(m), true) = (m, lo < hi) {
                sum = sum.wrapping_add(m.touch(lo - first..hi - first));
            }
            first += count;
        }
        sum
    };
    let sum: u64 = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..readers)
            .map(|r| {
                let touch = &touch;
                scope.spawn(move || touch((r * n / readers, (r + 1) * n / readers)))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a limit reader panicked"))
            .fold(0, u64::wrapping_add)
    });
    drop(mapped);
    std::hint::black_box(sum);
    let readers = super::plural(readers, "thread");
    let what = format!("the warm files mapped, one byte of every 4 KiB page read, {readers}");
    Limit::rate(total(&sizes), started, what)
}

/// Ranged reads of every shard's bytes through its own source (the object-store client the
/// loader uses), `concurrency` at once, `block` bytes each, discarded.
pub(super) fn ranged_get(shards: &[Shard], concurrency: usize, block: u64) -> Limit {
    let mut jobs = Vec::new();
    for shard in shards {
        let mut offset = 0;
        while offset < shard.size {
            let len = (shard.size - offset).min(block);
            jobs.push((shard.source.clone(), offset, len as usize));
            offset += block;
        }
    }
    let bytes: u64 = shards.iter().map(|s| s.size).sum();
    let what = format!(
        "ranged GETs, {concurrency} in flight x {}, same client",
        Size(block)
    );
    let started = Instant::now();
    let result = crate::runtime::block_on(
        "the ranged-GET limit",
        stream::iter(jobs)
            .map(|(source, offset, len)| async move {
                let mut buf = vec![0u8; len];
                source.read_into(offset, &mut buf).await
            })
            .buffer_unordered(concurrency.max(1))
            .try_collect::<Vec<()>>(),
    );
    match result {
        Ok(_) => Limit::rate(bytes, started, what),
        Err(e) => Limit::unmeasurable(format!("not measurable here: {e}")),
    }
}

/// Copies of `block` bytes (clamped to 64 KiB..64 MiB) from one page-locked staging buffer into
/// one device buffer through the engine, enough of them to move about `bytes` (at least 8, at
/// most 256), timed on the host clock from the first enqueue until a fence after the last one
/// passed (one untimed copy first).
///
/// A driver call that fails is the bench's error, as it would be in a run: the device, not the
/// measurement, is what is broken.
pub(super) fn host_to_device(
    target: Option<Target>,
    bytes: u64,
    block: u64,
    times: u32,
) -> crate::Result<Limit> {
    let Some(mut target) = target else {
        return Ok(Limit::unmeasurable("no device".into()));
    };
    let block = block.clamp(64 << 10, 64 << 20) as usize;
    let copies = (bytes / block as u64).clamp(8, 256) as usize;
    let what = format!(
        "page-locked host to {}, {copies} copies x {}",
        target.engine.name(),
        Size(block as u64)
    );
    let mut measure = || -> crate::Result<f64> {
        let engine = Arc::clone(&target.engine);
        engine.enter()?;
        let mut staging = engine.staging(block)?;
        staging.slice_mut(block).fill(1);
        let slot = TensorSlot {
            name: "host_to_device".into(),
            dtype: Dtype::U8,
            shape: vec![block as u64],
            offset: 0,
            len: block as u64,
            piece: None,
        };
        let allocation = target.allocator.allocate(std::slice::from_ref(&slot))?;
        let dst = allocation.destinations[0].addr;
        if let Some(stream) = allocation.stream {
            engine.order_after(stream)?;
        }
        // SAFETY: `staging` and the destination (owned by `allocation`) outlive every copy: the
        // fences below are waited for before either is dropped; nothing else writes them.
        #[allow(unsafe_code)]
        unsafe {
            engine.copy(dst, staging.as_ptr(), block)?;
            engine.wait(engine.record()?)?;
            let started = Instant::now();
            for _ in 0..copies {
                engine.copy(dst, staging.as_ptr(), block)?;
            }
            engine.wait(engine.record()?)?;
            let s = started.elapsed().as_secs_f64();
            drop(allocation);
            Ok((block * copies) as f64 / s.max(1e-9) / 1e9)
        }
    };
    Limit::try_best_of(times, || {
        Ok(Limit {
            gb_per_s: Some(measure()?),
            what: what.clone(),
            bytes: (block * (copies + 1)) as u64,
        })
    })
}

/// Pages of `path` in the page cache and pages in all (`mincore` over a read-only mapping);
/// `None` when the kernel cannot tell.
#[allow(unsafe_code)]
pub(super) fn resident(path: &std::path::Path) -> Option<(usize, usize)> {
    let file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len() as usize;
    if len == 0 {
        return Some((0, 0));
    }
    let pages = len.div_ceil(PAGE);
    let mut vec = vec![0u8; pages];
    let mapping = Mapping::new(&file, len).ok()?;
    // SAFETY: `mapping` is a read-only mapping of `len` bytes, unmapped when dropped; mincore
    // writes one byte per page into `vec`, which holds `pages` bytes.
    let rc = unsafe { libc::mincore(mapping.addr, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    Some((vec.iter().filter(|&&b| b & 1 == 1).count(), pages))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_the_best_of_its_passes() {
        let rates = [Some(1.0), Some(3.0), Some(2.0)];
        let mut i = 0;
        let best = Limit::best_of(3, || {
            i += 1;
            Limit {
                gb_per_s: rates[i - 1],
                what: "pass".into(),
                bytes: 10,
            }
        });
        assert_eq!((best.gb_per_s, best.bytes, i), (Some(3.0), 30, 3));
        assert_eq!(best.what, "pass; best of 3");
        // One that cannot be measured is not tried again.
        let mut tries = 0;
        let none = Limit::best_of(3, || {
            tries += 1;
            Limit::unmeasurable("not here".into())
        });
        assert_eq!(
            (none.gb_per_s, tries, none.what.as_str()),
            (None, 1, "not here")
        );
    }

    #[test]
    fn blocks_cover_every_file_aligned() {
        let jobs = blocks(&[10_000, 0, 8192], 4096);
        assert_eq!(
            jobs,
            vec![
                (0, 0, 4096),
                (0, 4096, 4096),
                (0, 8192, 4096),
                (2, 0, 4096),
                (2, 4096, 4096)
            ]
        );
        let mut buf = AlignedBuf::new(100);
        assert_eq!(buf.as_mut().as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.as_mut().len(), 100);
    }

    #[test]
    fn limits_read_every_byte_of_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 3 << 20]).unwrap();
        let files = vec![path.clone()];
        let warm = buffered(&files, 8, 1 << 20, "warm");
        assert!(warm.gb_per_s.unwrap() > 0.0, "{warm:?}");
        assert!(warm.what.contains("3 readers x 1MiB pread"), "{warm:?}");
        // One block: one reader, not "1 readers".
        let one = buffered(&files, 8, 4 << 20, "warm");
        assert!(one.what.ends_with("warm, 1 reader x 4MiB pread"), "{one:?}");
        // O_DIRECT is refused on some filesystems (tmpfs): then the limit says so.
        let direct = storage_direct(&files, 4, 1 << 20);
        assert!(
            direct.gb_per_s.is_some() || direct.what.starts_with("not measurable here"),
            "{direct:?}"
        );
        // A mapping touched page by page, empty files among them.
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        let touched = mapped_touch(&[path.clone(), empty.clone()], 2);
        assert!(touched.gb_per_s.unwrap() > 0.0, "{touched:?}");
        assert_eq!(touched.bytes, 3 << 20);
        // 3 MiB: one thread (a thread per 32 MiB at most).
        assert!(touched.what.ends_with("page read, 1 thread"), "{touched:?}");
        let big = dir.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(40 << 20)
            .unwrap();
        let touched = mapped_touch(&[big, empty], 8);
        assert!(
            touched.what.ends_with("page read, 2 threads"),
            "{touched:?}"
        );
        let (res, pages) = resident(&path).unwrap();
        assert_eq!(pages, 768);
        assert!(res <= pages);
    }
}
