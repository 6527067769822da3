//! A large local file's bytes go to the disk around the page cache (`O_DIRECT`), through a few
//! reused, pre-faulted buffers: the caller copies each piece into the buffer being filled (warm
//! memory, several GB/s) while a thread of the file writes the buffers filled before.
//!
//! Why: a buffered write copies every byte into page-cache pages the kernel allocates for the
//! file, and on the VMs this runs on (free memory is handed back to the host) the first touch of
//! those pages runs at a fraction of copy speed and varies tenfold from run to run: `perf` put a
//! slow 512 MiB `save_file` almost wholly in the kernel's copy into the page cache
//! (`copy_folio_from_iter_atomic`). Direct writes are DMA from memory that was faulted in once.
//!
//! Direct I/O needs aligned offsets, lengths and addresses ([`ALIGN`], which covers the usual
//! devices); the file's last bytes that do not fill an aligned block go through the page cache
//! (`O_DIRECT` turned off for that one write). A filesystem that refuses `O_DIRECT` (when set, or
//! on a write, with `EINVAL`) is written through the page cache, from the same buffers.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

use crate::error::Result;
use crate::memory::HostBuffer;

/// Bytes per buffer, and per write: 8 MiB requests keep a virtio disk's queue busy (a request
/// is split at 4 MiB there) at a small cost in memory.
const BUFFER: usize = 8 << 20;
/// Buffers per file: one being filled while the others are written or wait their turn.
const BUFFERS: usize = 3;
/// Offsets, lengths and addresses of direct writes are multiples of this.
const ALIGN: usize = 4096;
/// Files shorter than this are written through the page cache as they come (an index, a
/// config): a thread and 24 MiB of buffers are not worth it for them.
pub const MIN_LEN: u64 = 2 * BUFFER as u64;

/// A filled buffer on its way to the file.
struct Chunk {
    buf: HostBuffer,
    len: usize,
    offset: u64,
}

/// Writes a file from offset 0, sequentially, around the page cache.
pub struct DirectWriter {
    /// The buffer being filled, and how many of its bytes are.
    current: Option<HostBuffer>,
    fill: usize,
    /// The file offset of `current`'s first byte.
    offset: u64,
    /// Buffers not given to the thread yet.
    spare: Vec<HostBuffer>,
    to_disk: Option<SyncSender<Chunk>>,
    /// Buffers back from the thread once written, or the error that stopped it.
    back: Receiver<io::Result<HostBuffer>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DirectWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirectWriter(at {} + {})", self.offset, self.fill)
    }
}

impl DirectWriter {
    /// Starts writing `file` (empty, opened for writing) around the page cache; `None` where the
    /// filesystem refuses `O_DIRECT` (the caller writes through the page cache then).
    pub fn start(file: &File, shown: &str) -> Result<Option<DirectWriter>> {
        let io = |e| crate::error::Error::io(shown, e);
        if set_direct(file, true).is_err() {
            return Ok(None);
        }
        let spare = (0..BUFFERS)
            .map(|_| HostBuffer::alloc_populated(BUFFER, "write buffers"))
            .collect::<Result<Vec<_>>>()?;
        let out = file.try_clone().map_err(io)?;
        let (to_disk, chunks) = sync_channel::<Chunk>(BUFFERS);
        // Room for every buffer: the thread never waits to give one back.
        let (done, back) = sync_channel(BUFFERS);
        let thread = std::thread::Builder::new()
            .name("fastload-write".into())
            .spawn(move || write_chunks(&out, chunks, done))
            .map_err(io)?;
        Ok(Some(DirectWriter {
            current: None,
            fill: 0,
            offset: 0,
            spare,
            to_disk: Some(to_disk),
            back,
            thread: Some(thread),
        }))
    }

    /// Appends `data`: copied into the buffers, written as they fill. An error of an earlier
    /// write comes out here (or from [`DirectWriter::finish`]).
    pub fn write(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let buf = match self.current.take() {
                Some(b) => b,
                None => self.buffer()?,
            };
            let n = data.len().min(BUFFER - self.fill);
            #[allow(unsafe_code)]
            // SAFETY: `buf` is ours alone (not with the thread) and `fill + n <= BUFFER`, its
            // length.
            let to = unsafe { buf.slice_mut(self.fill, n) };
            to.copy_from_slice(&data[..n]);
            self.current = Some(buf);
            self.fill += n;
            data = &data[n..];
            if self.fill == BUFFER {
                self.send()?;
            }
        }
        Ok(())
    }

    /// Writes what is left and waits for every write; the first error of any comes out here.
    pub fn finish(mut self) -> io::Result<()> {
        if self.fill > 0 {
            self.send()?;
        }
        self.to_disk.take();
        let mut out = Ok(());
        for r in self.back.iter() {
            if let (Err(e), Ok(())) = (r, &out) {
                out = Err(e);
            }
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        out
    }

    /// A buffer to fill: a spare one, or the next one the thread is done with.
    fn buffer(&mut self) -> io::Result<HostBuffer> {
        if let Some(b) = self.spare.pop() {
            return Ok(b);
        }
        match self.back.recv() {
            Ok(r) => r,
            Err(_) => Err(io::Error::other("the file's write thread stopped")),
        }
    }

    fn send(&mut self) -> io::Result<()> {
        let buf = self.current.take().expect("a buffer being filled");
        let chunk = Chunk {
            buf,
            len: self.fill,
            offset: self.offset,
        };
        self.offset += self.fill as u64;
        self.fill = 0;
        let sent = self.to_disk.as_ref().map(|t| t.send(chunk));
        if let Some(Ok(())) = sent {
            return Ok(());
        }
        // The thread stopped at an error: its last message.
        Err(self
            .back
            .iter()
            .find_map(|r| r.err())
            .unwrap_or_else(|| io::Error::other("the file's write thread stopped")))
    }
}

impl Drop for DirectWriter {
    /// Unfinished (an abort): the writes queued end before the buffers go.
    fn drop(&mut self) {
        self.to_disk.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: writes each chunk at its offset and gives its buffer back; stops at an error.
fn write_chunks(file: &File, chunks: Receiver<Chunk>, done: SyncSender<io::Result<HostBuffer>>) {
    let mut direct = true;
    for chunk in chunks {
        let r = write_chunk(file, &chunk, &mut direct);
        let failed = r.is_err();
        let _ = done.send(r.map(|()| chunk.buf));
        if failed {
            return;
        }
    }
}

/// Writes the chunk's aligned bytes directly (while `direct`) and the rest through the page
/// cache, turning `O_DIRECT` off for good (the file's last bytes, or a write it refused).
fn write_chunk(file: &File, chunk: &Chunk, direct: &mut bool) -> io::Result<()> {
    let data = &chunk.buf.as_slice()[..chunk.len];
    let aligned_buf = chunk.buf.as_ptr() as usize % ALIGN == 0 && chunk.offset % ALIGN as u64 == 0;
    let aligned = if *direct && aligned_buf {
        chunk.len / ALIGN * ALIGN
    } else {
        0
    };
    if aligned > 0 {
        match file.write_all_at(&data[..aligned], chunk.offset) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // Refused (an alignment this device wants larger): the page cache it is; the
                // whole range again, as a part of it may have been written.
                set_direct(file, false)?;
                *direct = false;
                file.write_all_at(&data[..aligned], chunk.offset)?;
            }
            Err(e) => return Err(e),
        }
    }
    if aligned < chunk.len {
        if *direct {
            set_direct(file, false)?;
            *direct = false;
        }
        file.write_all_at(&data[aligned..], chunk.offset + aligned as u64)?;
    }
    Ok(())
}

/// Turns `O_DIRECT` on or off for `file` (and every descriptor sharing its open file).
#[cfg(target_os = "linux")]
fn set_direct(file: &File, on: bool) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    #[allow(unsafe_code)]
    // SAFETY: `fd` is open, owned by `file` for the duration of the calls; F_GETFL/F_SETFL
    // take and return plain flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let want = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        if want != flags && libc::fcntl(fd, libc::F_SETFL, want) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// No `O_DIRECT` here: files are written through the page cache.
#[cfg(not(target_os = "linux"))]
fn set_direct(_file: &File, on: bool) -> io::Result<()> {
    if on {
        Err(io::ErrorKind::Unsupported.into())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes whose every position differs from its neighbours (a misplaced chunk shows).
    fn pattern(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i % 251) as u8 ^ (i >> 16) as u8)
            .collect()
    }

    #[test]
    fn pieces_of_any_size_land_in_order_with_an_unaligned_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        let file = File::create(&path).unwrap();
        // Pieces straddle buffers; the end is not a multiple of ALIGN.
        let want = pattern(3 * BUFFER + 5 * ALIGN + 123);
        let Some(mut w) = DirectWriter::start(&file, "x.bin").unwrap() else {
            return; // A filesystem without O_DIRECT: nothing of this writer to test here.
        };
        for piece in want.chunks(BUFFER / 3 + 17) {
            w.write(piece).unwrap();
        }
        w.finish().unwrap();
        file.sync_all().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }

    #[test]
    fn a_failed_write_is_reported_and_stops_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, b"").unwrap();
        // Read-only: every write fails with EBADF.
        let file = File::open(&path).unwrap();
        let Some(mut w) = DirectWriter::start(&file, "x.bin").unwrap() else {
            return;
        };
        let data = pattern(BUFFER);
        let mut failed = None;
        for _ in 0..2 * BUFFERS {
            if let Err(e) = w.write(&data) {
                failed = Some(e);
                break;
            }
        }
        let e = match failed {
            Some(e) => e,
            None => w.finish().unwrap_err(),
        };
        assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{e}");
    }
}
