//! Local files: written under a temporary name in the destination's folder, synced, then renamed
//! into place, so that a reader sees the whole file or none. Without `overwrite` the file is
//! published with a hard link, which fails atomically when the destination exists (then a rename
//! after a check, where the filesystem has no hard links). A writer killed with SIGKILL leaves its
//! temporary file (`.NAME.<pid>-<n>.fastload-tmp`, which no loader takes for a checkpoint).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::direct::{self, DirectWriter};
use super::WriteOptions;
use crate::error::{Error, Result};

/// A local file being written.
#[derive(Debug)]
pub struct LocalFile {
    dest: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
    /// A large file's bytes, on their way around the page cache (see `direct`).
    direct: Option<Box<DirectWriter>>,
    shown: String,
    overwrite: bool,
    /// A write or sync failed: the temporary file may lack bytes, so it is never published
    /// (a later `prepare` or `finish` fails too instead of finding nothing left to do).
    failed: bool,
}

/// Temporary files made by this process so far (their names must differ).
static COUNTER: AtomicU64 = AtomicU64::new(0);

impl LocalFile {
    /// Opens a temporary file beside `path` (creating missing folders), sized for `len` bytes.
    pub fn create(path: &str, len: u64, options: &WriteOptions) -> Result<LocalFile> {
        let shown = path.to_string();
        let dest = PathBuf::from(path);
        let io = |source: io::Error| Error::Io {
            path: shown.clone(),
            source,
        };
        let name = dest
            .file_name()
            .ok_or_else(|| {
                io(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a file name (the path ends with a folder)",
                ))
            })?
            .to_string_lossy()
            .into_owned();
        if dest.is_dir() {
            return Err(io(io::Error::new(
                io::ErrorKind::IsADirectory,
                "is a directory",
            )));
        }
        if !options.overwrite && dest.symlink_metadata().is_ok() {
            return Err(Error::Exists { path: shown });
        }
        let folder = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&folder).map_err(io)?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = folder.join(format!(".{name}.{}-{n}.fastload-tmp", std::process::id()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io)?;
        let mut out = LocalFile {
            dest,
            tmp,
            file: Some(file),
            direct: None,
            shown,
            overwrite: options.overwrite,
            failed: false,
        };
        // Reserve the space now where the filesystem can: a full disk fails before any byte is
        // written rather than after gigabytes.
        if len > 0 {
            if let Some(f) = &out.file {
                reserve(f, len).map_err(|e| out.error(e))?;
            }
        }
        if len >= direct::MIN_LEN {
            if let Some(f) = &out.file {
                out.direct = DirectWriter::start(f, &out.shown)?.map(Box::new);
            }
        }
        Ok(out)
    }

    pub fn shown(&self) -> &str {
        &self.shown
    }

    fn error(&self, source: io::Error) -> Error {
        Error::Io {
            path: self.shown.clone(),
            source,
        }
    }

    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let written = match (self.direct.as_mut(), self.file.as_mut()) {
            (Some(d), _) => d.write(data),
            (None, Some(file)) => file.write_all(data),
            (None, None) => Err(io::Error::other("written after prepare or finish")),
        };
        written.map_err(|e| self.fail(e))
    }

    /// Syncs the data and closes the file: complete and on disk, still under its temporary name
    /// (a shard set publishes its files only once every one is prepared). Again: nothing to do.
    pub fn prepare(&mut self) -> Result<()> {
        if self.failed {
            return Err(self.error(io::Error::other(
                "an earlier write or sync of this file failed",
            )));
        }
        if let Some(d) = self.direct.take() {
            d.finish().map_err(|e| self.fail(e))?;
        }
        if let Some(file) = self.file.take() {
            file.sync_all().map_err(|e| self.fail(e))?;
        }
        Ok(())
    }

    /// The error for `source`, with the file marked as never to be published.
    fn fail(&mut self, source: io::Error) -> Error {
        self.failed = true;
        self.error(source)
    }

    /// Prepares the file if it was not, then renames it into place and syncs the folder.
    pub fn finish(mut self) -> Result<()> {
        self.prepare()?;
        self.publish().map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists => Error::Exists {
                path: self.shown.clone(),
            },
            _ => self.error(e),
        })?;
        if let Some(folder) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            // The rename itself must reach the disk; some filesystems cannot sync a folder.
            let _ = File::open(folder).and_then(|f| f.sync_all());
        }
        Ok(())
    }

    fn publish(&self) -> io::Result<()> {
        if self.overwrite {
            return std::fs::rename(&self.tmp, &self.dest);
        }
        match std::fs::hard_link(&self.tmp, &self.dest) {
            Ok(()) => {
                let _ = std::fs::remove_file(&self.tmp);
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
            Err(_) => {
                // No hard links here: a check, then a rename (a writer racing in between wins).
                if self.dest.symlink_metadata().is_ok() {
                    return Err(io::ErrorKind::AlreadyExists.into());
                }
                std::fs::rename(&self.tmp, &self.dest)
            }
        }
    }

    pub fn abort(mut self) -> Result<()> {
        self.file.take();
        match std::fs::remove_file(&self.tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(self.error(e)),
            _ => Ok(()),
        }
    }
}

impl super::Sink for LocalFile {
    fn uri(&self) -> &str {
        self.shown()
    }

    fn is_local(&self) -> bool {
        true
    }

    fn holds_at_most(&self) -> u64 {
        0
    }

    fn write(&mut self, data: bytes::Bytes) -> Result<()> {
        LocalFile::write(self, &data)
    }

    fn prepare(&mut self) -> Result<()> {
        LocalFile::prepare(self)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        LocalFile::finish(*self)
    }

    fn abort(self: Box<Self>) -> Result<()> {
        LocalFile::abort(*self)
    }
}

impl Drop for LocalFile {
    fn drop(&mut self) {
        // Not published (finish failed, or the writer was dropped): the temporary file goes.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Allocates `len` bytes for `file` (fallocate); filesystems without it are left to fail on write.
fn reserve(file: &File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let Ok(len) = libc::off_t::try_from(len) else {
        return Ok(());
    };
    #[allow(unsafe_code)]
    // SAFETY: the descriptor is open and owned by `file` for the duration of the call.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    match rc {
        0 => Ok(()),
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Err(io::Error::from_raw_os_error(rc)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(overwrite: bool) -> WriteOptions {
        WriteOptions {
            overwrite,
            ..Default::default()
        }
    }

    #[test]
    fn appears_only_when_finished_and_refuses_to_replace() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("sub").join("x.bin");
        let d = dest.to_str().unwrap();
        let mut f = LocalFile::create(d, 3, &opts(false)).unwrap();
        f.write(b"abc").unwrap();
        assert!(!dest.exists());
        f.finish().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"abc");
        let again = LocalFile::create(d, 1, &opts(false)).unwrap_err();
        assert!(matches!(again, Error::Exists { .. }), "{again}");
        let mut f = LocalFile::create(d, 1, &opts(true)).unwrap();
        f.write(b"z").unwrap();
        f.finish().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"z");
        let names: Vec<_> = std::fs::read_dir(dest.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["x.bin"]);
    }

    #[test]
    fn a_race_to_the_same_name_has_one_winner() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.bin");
        let d = dest.to_str().unwrap();
        let mut a = LocalFile::create(d, 1, &opts(false)).unwrap();
        let mut b = LocalFile::create(d, 1, &opts(false)).unwrap();
        a.write(b"a").unwrap();
        b.write(b"b").unwrap();
        a.finish().unwrap();
        assert!(matches!(b.finish(), Err(Error::Exists { .. })));
        assert_eq!(std::fs::read(&dest).unwrap(), b"a");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn prepared_is_complete_but_invisible_until_finished() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.bin");
        let mut f = LocalFile::create(dest.to_str().unwrap(), 3, &opts(false)).unwrap();
        f.write(b"abc").unwrap();
        f.prepare().unwrap();
        f.prepare().unwrap();
        assert!(!dest.exists());
        let tmp: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(tmp.len(), 1);
        assert_eq!(
            std::fs::read(tmp[0].as_ref().unwrap().path()).unwrap(),
            b"abc"
        );
        f.finish().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"abc");
        let mut g = LocalFile::create(dest.to_str().unwrap(), 1, &opts(true)).unwrap();
        g.write(b"z").unwrap();
        g.prepare().unwrap();
        drop(g);
        assert_eq!(std::fs::read(&dest).unwrap(), b"abc");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_write_is_never_published() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("x.bin");
        let mut f = LocalFile::create(dest.to_str().unwrap(), 4, &opts(true)).unwrap();
        f.write(b"ab").unwrap();
        f.prepare().unwrap();
        // A write after the file was closed fails, and from then on nothing publishes it.
        assert!(f.write(b"cd").is_err());
        assert!(f.prepare().is_err());
        assert!(f.finish().is_err());
        assert!(!dest.exists());
    }

    #[test]
    fn dropped_or_aborted_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("x.bin");
        let mut f = LocalFile::create(d.to_str().unwrap(), 2, &opts(false)).unwrap();
        f.write(b"a").unwrap();
        drop(f);
        let f = LocalFile::create(d.to_str().unwrap(), 2, &opts(false)).unwrap();
        f.abort().unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
