//! The page cache as `fastload bench` drives it: files evicted before a cold run (and whether
//! that took effect), read once before a warm one, and the pages of what a run delivered touched
//! as a consumer would.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::limits;
use super::{CliError, CliResult};

/// Stride of the consumer's reads: one byte per page makes every page resident and readable
/// without turning the benchmark into a memory-bandwidth test.
const PAGE: usize = 4096;

/// Drops the file's pages from the page cache so the next read goes to storage.
#[allow(unsafe_code)]
fn evict(path: &Path) -> CliResult {
    let io_error = |source| CliError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    // SAFETY: posix_fadvise takes an open descriptor (kept alive by `file` for the call) and
    // plain integers; it does not touch this process's memory.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(io_error(std::io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

/// Evicts every file; true when that took effect (at most a tenth of their pages still
/// resident). On failure (or on e.g. tmpfs, where eviction does nothing) it says so on stderr
/// once per `said`.
pub(super) fn evict_all(files: &[PathBuf], said: &mut bool) -> bool {
    let mut ok = true;
    for f in files {
        if let Err(e) = evict(f) {
            if !*said {
                eprintln!("fastload: note: cannot evict from the page cache: {e}");
            }
            ok = false;
        } else if let Some((resident, pages)) = limits::resident(f) {
            ok &= resident * 10 <= pages;
        }
    }
    if !ok && !*said {
        eprintln!("fastload: note: eviction did not take effect here: the cold runs read memory");
    }
    *said |= !ok;
    ok
}

/// Reads the files once through the page cache.
pub(super) fn warm_up(files: &[PathBuf]) {
    drop(limits::buffered(
        files,
        limits::COLD_READERS,
        8 << 20,
        "warm-up",
    ));
}

/// Reads one byte of every page (and the last byte), as a consumer of the tensors would.
pub(super) fn touch_pages(bytes: &[u8]) -> u64 {
    let bytes = std::hint::black_box(bytes);
    let mut sum = bytes.last().map_or(0, |&b| b as u64);
    for i in (0..bytes.len()).step_by(PAGE) {
        sum = sum.wrapping_add(bytes[i] as u64);
    }
    std::hint::black_box(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touches_every_page() {
        let mut data = vec![0u8; 3 * PAGE + 10];
        data[0] = 1;
        data[PAGE] = 2;
        data[2 * PAGE] = 4;
        data[3 * PAGE] = 8;
        *data.last_mut().unwrap() = 16;
        assert_eq!(touch_pages(&data), 31);
        assert_eq!(touch_pages(&[]), 0);
    }
}
