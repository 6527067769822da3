//! Host buffers. Two kinds:
//! - anonymous memory from a process-wide pool: fresh pages are faulted in by the reader threads
//!   (`MADV_POPULATE_WRITE`, in parallel, before the read lands) and freed buffers go back to the
//!   pool, so a consumer that drops each tensor keeps reusing already-faulted memory, split to
//!   size or stitched from several freed buffers by moving their pages;
//! - private mappings of a window of a local file, populated from the page cache in parallel:
//!   no copy at all, the pages the kernel already holds become the tensor's memory. A window
//!   whose pages are all in the page cache already is not populated (see
//!   [`HostBuffer::map_file`]).
//!
//! Page faults on fresh memory are the dominant cost on small VMs (a fresh fill runs at well under
//! 1 GB/s while a pre-faulted copy runs at several GB/s), hence the pool.

#![allow(unsafe_code)]

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::per_process::PerProcess;

const ALIGN: usize = 2 << 20;

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Freed anonymous memory kept for reuse: `(address, bytes)` ranges, each a multiple of
/// [`ALIGN`], whose pages are already faulted in.
struct Pool {
    free: Vec<(usize, usize)>,
    cached: usize,
    limit: usize,
}

/// One pool per process: a child forked while a loading thread held the pool's lock gets its own
/// (see `per_process`).
static POOL: PerProcess<Pool> = PerProcess::new(|| Pool {
    free: Vec::new(),
    cached: 0,
    limit: 0,
});

/// What [`Pool::take`] found for a request.
#[derive(Debug, PartialEq)]
enum Taken {
    /// Nothing pooled: map fresh memory.
    Nothing,
    /// `cap` pooled bytes at this address, every page faulted in.
    Whole(usize),
    /// A new mapping of `cap` bytes whose first `reused` bytes are pooled pages moved in (the
    /// rest is fresh).
    Stitched { addr: usize, reused: usize },
}

impl Pool {
    /// Takes `cap` bytes. The smallest entry that holds them is used (its tail stays pooled);
    /// when none does, pooled ranges, largest first, are moved with `mremap` into one new
    /// contiguous mapping: page-table moves, no copy and no zeroing, so a tensor larger than
    /// any freed buffer still reuses their pages. Fresh memory costs far more than moving
    /// pages on small VMs.
    fn take(&mut self, cap: usize) -> Result<Taken> {
        let fits = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, &(_, c))| c >= cap)
            .min_by_key(|(_, &(_, c))| c)
            .map(|(i, _)| i);
        if let Some(i) = fits {
            let (addr, c) = self.free.swap_remove(i);
            self.cached -= c;
            if c > cap {
                self.put(addr + cap, c - cap);
            }
            return Ok(Taken::Whole(addr));
        }
        if self.free.is_empty() {
            return Ok(Taken::Nothing);
        }
        let addr = map_anonymous(cap)?;
        let mut reused = 0;
        self.free.sort_unstable_by_key(|&(_, c)| c);
        while reused < cap {
            let Some((from, c)) = self.free.pop() else {
                break;
            };
            let n = c.min(cap - reused);
            // SAFETY: `from..from + n` is pooled memory nobody references, and the target lies
            // inside the mapping made above; MREMAP_FIXED replaces the untouched pages there.
            let moved = unsafe {
                libc::mremap(
                    from as *mut libc::c_void,
                    n,
                    n,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    (addr + reused) as *mut libc::c_void,
                )
            };
            if moved == libc::MAP_FAILED {
                // Keep what was moved; the rest of the buffer is faulted in as fresh memory.
                self.free.push((from, c));
                break;
            }
            self.cached -= c;
            if c > n {
                self.put(from + n, c - n);
            }
            reused += n;
        }
        Ok(Taken::Stitched { addr, reused })
    }

    fn put(&mut self, addr: usize, cap: usize) {
        self.cached += cap;
        self.free.push((addr, cap));
    }

    /// Keeps a freed range if the limit allows; otherwise gives it back to the OS.
    fn give(&mut self, addr: usize, cap: usize) {
        if self.cached + cap <= self.limit {
            self.put(addr, cap);
        } else {
            unmap(addr, cap);
        }
    }

    fn trim(&mut self) {
        while self.cached > self.limit {
            let Some((addr, cap)) = self.free.pop() else {
                break;
            };
            self.cached -= cap;
            unmap(addr, cap);
        }
    }
}

fn map_anonymous(cap: usize) -> Result<usize> {
    // SAFETY: anonymous private mapping, no file; the result is checked.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            cap,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(Error::Memory {
            bytes: cap,
            what: String::new(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(addr as usize)
}

/// `cachestat(2)`'s answer (Linux 6.5+; its number is the same on every architecture).
#[repr(C)]
#[derive(Default)]
struct CacheStat {
    cache: u64,
    dirty: u64,
    writeback: u64,
    evicted: u64,
    recently_evicted: u64,
}

#[repr(C)]
struct CacheStatRange {
    off: u64,
    len: u64,
}

const SYS_CACHESTAT: libc::c_long = 451;

/// Whether the `len` bytes of `file` at `offset` (a multiple of the page size) are in the page
/// cache, judged from [`CACHE_SAMPLES`] pages spread evenly over the range (every page of a short
/// range). `cachestat` walks the cache page by page: over a whole 2 GiB file of small pages it
/// takes 7-12 ms here (`mincore` on a mapping takes as long as populating it), over one page a
/// microsecond. A miss the samples do not catch costs only speed: those pages are read when first
/// touched instead of in parallel now. Files are evicted and read in long runs, which the samples
/// do catch. `false` when the kernel cannot say (before Linux 6.5).
pub(crate) fn in_page_cache(file: &File, offset: u64, len: usize) -> bool {
    let page = page_size() as u64;
    let pages = (len as u64).div_ceil(page);
    if pages <= CACHE_SAMPLES {
        return cached_pages(file, offset, pages * page).is_some_and(|n| n >= pages);
    }
    (0..CACHE_SAMPLES).all(|i| {
        // The first and the last page, and evenly between them.
        let at = offset + i * (pages - 1) / (CACHE_SAMPLES - 1) * page;
        cached_pages(file, at, page).is_some_and(|n| n >= 1)
    })
}

/// Pages sampled per range by [`in_page_cache`].
const CACHE_SAMPLES: u64 = 16;

/// How many pages of `len` bytes of `file` at `offset` are in the page cache (`cachestat`).
fn cached_pages(file: &File, offset: u64, len: u64) -> Option<u64> {
    let range = CacheStatRange { off: offset, len };
    let mut stat = CacheStat::default();
    // SAFETY: both pointers are valid for the call; the flags argument must be 0.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CacheStatRange,
            &mut stat as *mut CacheStat,
            0u32,
        )
    };
    (rc == 0).then_some(stat.cache)
}

fn unmap(addr: usize, len: usize) {
    // SAFETY: (addr, len) is a mapping this module created and nobody references any more.
    unsafe {
        libc::munmap(addr as *mut libc::c_void, len);
    }
}

/// Sets how many bytes of freed buffers the pool keeps for reuse (the rest goes back to the OS).
pub fn set_pool_limit(bytes: u64) {
    let mut pool = POOL.lock();
    pool.limit = bytes as usize;
    pool.trim();
}

/// Bytes currently cached by the pool.
pub fn pool_cached() -> u64 {
    POOL.lock().cached as u64
}

/// Gives every cached buffer back to the OS and stops caching until the next load sets a limit:
/// buffers in use are unmapped when their last tensor is freed. Returns the bytes given back.
pub fn release_pool() -> u64 {
    let mut pool = POOL.lock();
    let cached = pool.cached as u64;
    pool.limit = 0;
    pool.trim();
    cached
}

enum Kind {
    /// Zero bytes: nothing allocated.
    Empty,
    /// From the anonymous pool; `cap` bytes mapped `lead` bytes before `ptr`.
    Anon { cap: usize, lead: usize },
    /// A private file mapping of `map_len` bytes at `base`; `ptr` points inside it.
    Mapped { base: usize, map_len: usize },
}

/// A contiguous buffer of host memory, owned by Rust until the last tensor viewing it is freed.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    kind: Kind,
    fresh: AtomicBool,
}

// SAFETY: the buffer is plain memory; concurrent writes go to disjoint ranges (see `slice_mut`).
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// An anonymous buffer of `len` bytes, reused from the pool when one fits.
    pub fn alloc(len: usize) -> Result<HostBuffer> {
        HostBuffer::alloc_at(0, len)
    }

    /// An anonymous buffer of `len` bytes that starts `lead` bytes (under a page) into its
    /// allocation, which has room for a page after them too: the aligned span around bytes of a
    /// file at an offset `lead` past a page boundary, for reads around the page cache
    /// ([`HostBuffer::span_mut`]).
    pub fn alloc_at(lead: usize, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Ok(HostBuffer {
                ptr: NonNull::dangling(),
                len: 0,
                kind: Kind::Empty,
                fresh: AtomicBool::new(false),
            });
        }
        let room = if lead > 0 { lead + page_size() } else { 0 };
        let cap = (len + room).div_ceil(ALIGN) * ALIGN;
        let taken = POOL.lock().take(cap)?;
        let (addr, fresh) = match taken {
            Taken::Whole(addr) => (addr, false),
            Taken::Stitched { addr, reused } => (addr, reused < cap),
            Taken::Nothing => (map_anonymous(cap)?, true),
        };
        Ok(HostBuffer {
            // SAFETY: `lead < cap`: inside the mapping.
            ptr: NonNull::new(unsafe { (addr as *mut u8).add(lead) })
                .expect("mapped address is not null"),
            len,
            kind: Kind::Anon { cap, lead },
            fresh: AtomicBool::new(fresh),
        })
    }

    /// Like [`HostBuffer::alloc`], with every page faulted in (in bulk, which is several times
    /// faster than page by page as a copy writes); `what` names the memory in errors.
    pub fn alloc_populated(len: usize, what: &str) -> Result<HostBuffer> {
        let buffer = HostBuffer::alloc(len)?;
        if buffer.is_fresh() {
            buffer.populate(0, buffer.len(), what)?;
            buffer.mark_populated();
        }
        Ok(buffer)
    }

    /// A private, writable mapping of `len` bytes of `file` at `offset`. Pages are not faulted in
    /// yet: when some are not in the page cache, the buffer is fresh and [`HostBuffer::populate`]
    /// reads them (from several threads, in parallel with other windows' reads). When the pages are
    /// cached (sampled: see `in_page_cache`) there is nothing to read: the buffer is not fresh, and each page is mapped by the
    /// first access to it, as `safetensors.load_file`'s lazy mapping does. Populating would only
    /// set up the same page-table entries sooner, at the same cost (about 30 ms for 2 GiB here,
    /// longer than the whole rest of a warm load), which a consumer that reads only some tensors
    /// or pages never pays.
    pub fn map_file(file: &File, offset: u64, len: usize, name: &str) -> Result<HostBuffer> {
        if len == 0 {
            return HostBuffer::alloc(0);
        }
        let page = page_size() as u64;
        let aligned = offset - offset % page;
        let delta = (offset - aligned) as usize;
        let map_len = len + delta;
        // SAFETY: a private mapping of an open file; the range was checked against the file size
        // by the header validation; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                aligned as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOMEM) {
                return Err(Error::Memory {
                    bytes: map_len,
                    what: format!(" of {name}"),
                    source: e,
                });
            }
            return Err(Error::io(name, e));
        }
        Ok(HostBuffer {
            // SAFETY: delta < page <= map_len, inside the mapping.
            ptr: NonNull::new(unsafe { (base as *mut u8).add(delta) }).expect("mmap returned null"),
            len,
            kind: Kind::Mapped {
                base: base as usize,
                map_len,
            },
            fresh: AtomicBool::new(!in_page_cache(file, aligned, map_len)),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.kind, Kind::Mapped { .. })
    }

    /// A file mapping's whole pages (the first page's address and the length, in whole pages),
    /// made read-only first: what a device can be lent to copy from in place, page-locked where
    /// the pages are (`Engine::lend`). Read-only, so the device is never asked for write access,
    /// which pins a private mapping's pages only after copying each out of the page cache.
    /// `None` for memory that is not a file mapping.
    pub fn pages_read_only(&self) -> Option<std::io::Result<(usize, usize)>> {
        let Kind::Mapped { base, map_len } = self.kind else {
            return None;
        };
        let len = map_len.div_ceil(page_size()) * page_size();
        // SAFETY: `[base, base + len)` is this buffer's own mapping (mmap maps whole pages).
        let rc = unsafe { libc::mprotect(base as *mut libc::c_void, len, libc::PROT_READ) };
        if rc != 0 {
            return Some(Err(std::io::Error::last_os_error()));
        }
        Some(Ok((base, len)))
    }

    /// Whether the pages must be populated before use: a new anonymous mapping, or a new file
    /// mapping of pages not all in the page cache.
    pub fn is_fresh(&self) -> bool {
        self.fresh.load(Ordering::Relaxed)
    }

    /// Faults in `[off, off + len)`: for anonymous memory, writable zero pages; for a file
    /// mapping, the file's pages (reading them from storage if they are not cached).
    pub fn populate(&self, off: usize, len: usize, name: &str) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        assert!(off + len <= self.len, "populate range outside the buffer");
        let page = page_size();
        // SAFETY: the range lies inside this buffer's mapping.
        let start = unsafe { self.ptr.as_ptr().add(off) } as usize;
        let first = start - start % page;
        let end = start + len;
        let advice = if self.is_mapped() {
            libc::MADV_POPULATE_READ
        } else {
            libc::MADV_POPULATE_WRITE
        };
        // SAFETY: [first, end) lies within this buffer's mapping (page-rounded down inside it).
        let rc = unsafe { libc::madvise(first as *mut libc::c_void, end - first, advice) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                // Kernel without MADV_POPULATE_*: pages fault in on first use instead.
                Some(libc::EINVAL) => {}
                // Pages of a file mapping past the file's end: it was cut short after mapping.
                Some(libc::EFAULT) if self.is_mapped() => {
                    let message = "the file changed while loading: it was truncated (its pages \
                                   past the new end are gone)";
                    return Err(Error::io(name, std::io::Error::other(message)));
                }
                _ => return Err(Error::io(name, err)),
            }
        }
        Ok(())
    }

    /// Marks the buffer as populated (all ranges were faulted in).
    pub fn mark_populated(&self) {
        self.fresh.store(false, Ordering::Relaxed);
    }

    /// A mutable view of `[off, off + len)`.
    ///
    /// # Safety
    /// No other live reference may overlap this range: the pipeline hands every block of a buffer
    /// to exactly one reader, and publishes the buffer to consumers only after all reads ended.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len, "slice outside the buffer");
        std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len)
    }

    /// A mutable view of `len` bytes at `at` of the allocation around an anonymous buffer, which
    /// starts [`HostBuffer::alloc_at`]'s `lead` bytes before the buffer: where a read around the
    /// page cache puts an aligned span.
    ///
    /// # Safety
    /// As [`HostBuffer::slice_mut`]: no other live reference may overlap this range.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn span_mut(&self, at: usize, len: usize) -> &mut [u8] {
        let Kind::Anon { cap, lead } = self.kind else {
            panic!("a span of memory that is not an anonymous buffer");
        };
        assert!(at + len <= cap, "span outside the allocation");
        std::slice::from_raw_parts_mut(self.ptr.as_ptr().sub(lead).add(at), len)
    }

    /// The whole buffer, for reading once all writes are done.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the memory is valid for `len` bytes while `self` lives; callers read only after
        // the pipeline published the buffer (all writes finished).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match self.kind {
            Kind::Empty => {}
            Kind::Mapped { base, map_len } => unmap(base, map_len),
            Kind::Anon { cap, lead } => {
                let addr = self.ptr.as_ptr() as usize - lead;
                if self.is_fresh() {
                    // Some pages may never have been faulted in: not worth keeping.
                    unmap(addr, cap);
                } else {
                    POOL.lock().give(addr, cap);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // Tests that read the process-wide pool, or assert that an address is no longer mapped, run
    // in a process of their own: in the test binary's other threads, loads set the pool limit,
    // take pooled buffers and map new memory, possibly at the very addresses just freed.
    use rusty_fork::rusty_fork_test;

    rusty_fork_test! {
        #[test]
        fn pool_reuses_freed_buffers() {
            set_pool_limit(64 << 20);
            let a = HostBuffer::alloc(3 << 20).unwrap();
            a.populate(0, a.len(), "t").unwrap();
            a.mark_populated();
            let addr = a.as_ptr() as usize;
            drop(a);
            assert!(pool_cached() >= 4 << 20);
            let b = HostBuffer::alloc(3 << 20).unwrap();
            assert_eq!(b.as_ptr() as usize, addr);
            assert!(!b.is_fresh());
            drop(b);
            set_pool_limit(0);
            assert_eq!(pool_cached(), 0);
        }
    }

    fn local_pool() -> Pool {
        Pool {
            free: Vec::new(),
            cached: 0,
            limit: usize::MAX,
        }
    }

    /// Puts `cap` bytes filled with `byte` into `pool`.
    fn pooled(pool: &mut Pool, cap: usize, byte: u8) -> usize {
        let addr = map_anonymous(cap).unwrap();
        // SAFETY: a fresh mapping of `cap` bytes.
        unsafe { std::ptr::write_bytes(addr as *mut u8, byte, cap) };
        pool.put(addr, cap);
        addr
    }

    fn bytes(addr: usize, len: usize) -> &'static [u8] {
        // SAFETY: the tests read only ranges they mapped and have not unmapped.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
    }

    fn is_mapped(addr: usize, len: usize) -> bool {
        let mut residency = vec![0u8; len.div_ceil(page_size())];
        // SAFETY: mincore only reports; it fails with ENOMEM on unmapped ranges.
        unsafe { libc::mincore(addr as *mut libc::c_void, len, residency.as_mut_ptr()) == 0 }
    }

    fn release(pool: &mut Pool) {
        pool.limit = 0;
        pool.trim();
    }

    #[test]
    fn pool_splits_the_smallest_entry_that_fits() {
        let mut pool = local_pool();
        let big = pooled(&mut pool, 8 * ALIGN, 1);
        let small = pooled(&mut pool, 2 * ALIGN, 2);
        assert_eq!(pool.take(ALIGN).unwrap(), Taken::Whole(small));
        // The small entry's tail stays pooled, and serves the next small request.
        assert_eq!(pool.cached, 9 * ALIGN);
        assert_eq!(pool.take(ALIGN).unwrap(), Taken::Whole(small + ALIGN));
        assert_eq!(pool.take(4 * ALIGN).unwrap(), Taken::Whole(big));
        assert_eq!(pool.cached, 4 * ALIGN);
        unmap(small, 2 * ALIGN);
        unmap(big, 4 * ALIGN);
        release(&mut pool);
    }

    rusty_fork_test! {
        #[test]
        fn pool_stitches_freed_pages_into_a_larger_buffer() {
            let mut pool = local_pool();
            assert_eq!(pool.take(ALIGN).unwrap(), Taken::Nothing);
            let a = pooled(&mut pool, 2 * ALIGN, 1);
            let b = pooled(&mut pool, 3 * ALIGN, 2);
            let Taken::Stitched { addr, reused } = pool.take(4 * ALIGN).unwrap() else {
                panic!("expected a stitched buffer");
            };
            // Largest first: all of b, then the head of a; a's tail stays pooled.
            assert_eq!(reused, 4 * ALIGN);
            assert!(bytes(addr, 3 * ALIGN).iter().all(|&x| x == 2));
            assert!(bytes(addr + 3 * ALIGN, ALIGN).iter().all(|&x| x == 1));
            assert_eq!(pool.free, vec![(a + ALIGN, ALIGN)]);
            assert_eq!(pool.cached, ALIGN);
            // The pages moved: their old addresses are no longer mapped.
            assert!(!is_mapped(b, 3 * ALIGN) && !is_mapped(a, ALIGN));
            unmap(addr, 4 * ALIGN);

            // Not enough pooled: the rest of the buffer is fresh, zeroed memory.
            let Taken::Stitched { addr, reused } = pool.take(3 * ALIGN).unwrap() else {
                panic!("expected a stitched buffer");
            };
            assert_eq!((reused, pool.cached), (ALIGN, 0));
            assert!(bytes(addr, ALIGN).iter().all(|&x| x == 1));
            assert!(bytes(addr + ALIGN, 2 * ALIGN).iter().all(|&x| x == 0));
            unmap(addr, 3 * ALIGN);
        }
    }

    rusty_fork_test! {
        #[test]
        fn pool_keeps_at_most_its_limit() {
            let mut pool = local_pool();
            pool.limit = 3 * ALIGN;
            let a = map_anonymous(2 * ALIGN).unwrap();
            let b = map_anonymous(2 * ALIGN).unwrap();
            pool.give(a, 2 * ALIGN);
            pool.give(b, 2 * ALIGN);
            assert_eq!(pool.free, vec![(a, 2 * ALIGN)]);
            assert!(!is_mapped(b, 2 * ALIGN));
            release(&mut pool);
            assert!(!is_mapped(a, 2 * ALIGN) && pool.cached == 0);
        }
    }

    #[test]
    fn maps_unaligned_file_windows() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..20000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let b = HostBuffer::map_file(&f, 5000, 10000, "t").unwrap();
        b.populate(0, b.len(), "t").unwrap();
        assert_eq!(b.as_slice(), &data[5000..15000]);
    }
}
