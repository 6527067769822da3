//! Files on this machine: URI resolution (files, shard directories, index files, `file://`) and
//! positioned reads straight into the destination; files can also be mapped.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{DirectRead, Source};
use crate::error::{Error, Result};
use crate::format::{check_folder, index_shard_names, FormatError, INDEX_FILE};
use crate::memory::HostBuffer;

/// A local file, checked to be a regular file.
///
/// No descriptor is kept: every read opens the file, checks that it is still the file whose
/// header was read (same device and inode), reads and closes it. So the files open at once are
/// bounded by the reads in flight (`concurrency`, and 16 header reads), whatever the shard count:
/// 1,500 shards load under `ulimit -n 1024`. An `open` + `fstat` costs microseconds against a
/// block's milliseconds. Reopening by path also sees a file replaced under a running load, which
/// then fails with a clear error instead of mixing two files' bytes.
#[derive(Debug)]
pub struct LocalFile {
    name: String,
    path: PathBuf,
    size: u64,
    id: (u64, u64),
    /// Modification time when opened (seconds, nanoseconds): with the size, its version.
    modified: (i64, i64),
}

impl LocalFile {
    /// Checks `path` without opening it: a directory, FIFO, device or socket is refused here,
    /// before any header is read (opening a FIFO would block until a writer came).
    pub fn open(path: &Path) -> Result<LocalFile> {
        let name = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(&name, e))?;
        if meta.is_dir() {
            return Err(Error::format(&name, FormatError::IsDirectory));
        }
        if !meta.is_file() {
            let kind = crate::bounded::file_kind(&meta);
            return Err(Error::format(&name, FormatError::NotARegularFile { kind }));
        }
        Ok(LocalFile {
            name,
            path: path.to_path_buf(),
            size: meta.len(),
            id: (meta.dev(), meta.ino()),
            modified: (meta.mtime(), meta.mtime_nsec()),
        })
    }

    /// The file, opened for one read and checked to be the one this source describes.
    fn reopen(&self) -> Result<File> {
        self.reopen_with(0)
    }

    /// [`LocalFile::reopen`] with open `flags` besides (`O_DIRECT`).
    fn reopen_with(&self, flags: libc::c_int) -> Result<File> {
        // O_NONBLOCK: should a FIFO have been put at the path since, opening it does not block
        // (for a regular file the flag changes nothing).
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | flags)
            .open(&self.path)
            .map_err(|e| Error::io(&self.name, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&self.name, e))?;
        self.same_file(&meta)?;
        Ok(file)
    }

    fn same_file(&self, meta: &std::fs::Metadata) -> Result<()> {
        if (meta.dev(), meta.ino()) != self.id {
            return Err(self.changed("it was replaced (another file is at this path now)"));
        }
        if meta.len() < self.size {
            let reason = format!(
                "it was truncated to {} bytes (it had {} when its header was read)",
                meta.len(),
                self.size
            );
            return Err(self.changed(&reason));
        }
        Ok(())
    }

    fn changed(&self, reason: &str) -> Error {
        Error::Io {
            path: self.name.clone(),
            source: std::io::Error::other(format!("the file changed while loading: {reason}")),
        }
    }
}

impl Source for LocalFile {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn reads_block(&self) -> bool {
        true
    }

    fn read_cost(&self) -> u64 {
        super::LOCAL_READ_COST
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        // pread blocks: on an async worker, hand its other tasks to another thread meanwhile (on
        // a blocking thread, where the pipeline runs file reads, this just runs the closure).
        Box::pin(async move {
            tokio::task::block_in_place(|| read_exact_at(&self.reopen()?, dst, offset, &self.name))
        })
    }

    fn read_head<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            tokio::task::block_in_place(|| {
                let file = self.reopen()?;
                // SAFETY: an open descriptor and plain integers; advice only (errors ignored).
                #[allow(unsafe_code)]
                unsafe {
                    libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
                }
                read_exact_at(&file, dst, offset, &self.name)
            })
        })
    }

    fn map(&self, offset: u64, len: usize) -> Option<Result<HostBuffer>> {
        Some(
            self.reopen()
                .and_then(|file| HostBuffer::map_file(&file, offset, len, &self.name)),
        )
    }

    fn read_direct(&self, offset: u64, dst: &mut [u8]) -> Result<DirectRead> {
        let align = super::direct_align();
        debug_assert!(
            offset % align as u64 == 0
                && dst.len() % align == 0
                && dst.as_ptr() as usize % align == 0,
            "an unaligned read around the page cache"
        );
        let file = match self.reopen_with(libc::O_DIRECT) {
            // What filesystems without direct I/O (tmpfs, some FUSE) answer.
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                return Ok(DirectRead::Refused(format!(
                    "its filesystem refuses O_DIRECT ({source})"
                )))
            }
            opened => opened?,
        };
        if crate::memory::in_page_cache(&file, offset, dst.len()) {
            return Ok(DirectRead::Cached);
        }
        let mut done = 0usize;
        while done < dst.len() {
            match file.read_at(&mut dst[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    if n % align != 0 {
                        break; // the file's end: direct reads past it come back short
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if done == 0 && e.raw_os_error() == Some(libc::EINVAL) => {
                    return Ok(DirectRead::Refused(format!(
                        "its filesystem refused a read with O_DIRECT ({e})"
                    )))
                }
                Err(e) => return Err(Error::io(&self.name, e)),
            }
        }
        Ok(DirectRead::Read(done))
    }

    fn check_unchanged(&self) -> Result<()> {
        let meta = std::fs::metadata(&self.path).map_err(|e| Error::io(&self.name, e))?;
        self.same_file(&meta)
    }

    fn local_path(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn version(&self) -> Option<String> {
        let (secs, nanos) = self.modified;
        Some(format!("size {} modified {secs}.{nanos:09}", self.size))
    }
}

/// Reads exactly `buf.len()` bytes at `offset`, retrying interrupted and short reads.
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64, name: &str) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                let end = offset + done as u64;
                return Err(super::short_read(name, offset, buf.len() as u64, end));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(name, e)),
        }
    }
    Ok(())
}

/// Opens the files that local URIs name, each once, in a stable order.
pub fn open(uris: &[String]) -> Result<Vec<Arc<dyn Source>>> {
    if uris.is_empty() {
        return Ok(Vec::new());
    }
    resolve(uris)?
        .iter()
        .map(|p| Ok(Arc::new(LocalFile::open(p)?) as Arc<dyn Source>))
        .collect()
}

fn local_path(uri: &str) -> Result<PathBuf> {
    if uri.starts_with("file:") {
        // file:///abs/path, file://localhost/abs/path, percent-encoded as Path::as_uri() writes.
        return url::Url::parse(uri)
            .ok()
            .and_then(|u| u.to_file_path().ok())
            .ok_or_else(|| Error::UnsupportedUri {
                uri: uri.to_string(),
                message: "not a valid file:// URL with an absolute path".into(),
            });
    }
    if let Some((scheme, _)) = uri.split_once("://") {
        return Err(Error::UnsupportedUri {
            uri: uri.to_string(),
            message: format!(
                "scheme {scheme}:// is not supported by this build (local paths and file:// are)"
            ),
        });
    }
    Ok(PathBuf::from(uri))
}

/// The files an index names. The index is checked before a byte is read (a directory, FIFO or
/// device is refused, a FIFO without blocking) and read up to the cap on files read whole.
fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let name = index.display().to_string();
    let bytes = crate::bounded::read_file(index, &name, crate::bounded::Whole::Index).map_err(
        |e| match e {
            // A dangling symbolic link: say so (its name is listed, so "no such file" would
            // puzzle).
            Error::NotFound { path } => dangling(index).unwrap_or(Error::NotFound { path }),
            e => e,
        },
    )?;
    let dir = index.parent().unwrap_or(Path::new("."));
    Ok(index_shard_names(&bytes)
        .map_err(|e| Error::format(&name, e))?
        .into_iter()
        .map(|f| dir.join(f))
        .collect())
}

/// The error for `path` when it is a symbolic link to nothing.
fn dangling(path: &Path) -> Option<Error> {
    let target = std::fs::read_link(path).ok()?;
    Some(Error::Io {
        path: path.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "a symbolic link to {}, which does not exist",
                target.display()
            ),
        ),
    })
}

fn expand(uri: &str) -> Result<Vec<PathBuf>> {
    let path = local_path(uri)?;
    let meta = std::fs::metadata(&path).map_err(|e| Error::io(uri, e))?;
    if meta.is_dir() {
        // An index that is there in any form is used, or is the error: a dangling link, a
        // FIFO or a device named like the index is never skipped for the folder's other files.
        let index = path.join(INDEX_FILE);
        if std::fs::symlink_metadata(&index).is_ok() {
            return index_files(&index);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .map_err(|e| Error::io(uri, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            // Directories named *.safetensors are skipped; a FIFO, device or socket is kept, to
            // be refused with a clear error rather than left out unnoticed.
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors") && !p.is_dir())
            .collect();
        if files.is_empty() {
            return Err(Error::NoShards {
                path: uri.to_string(),
            });
        }
        files.sort();
        let names: Vec<_> = files
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy()))
            .collect();
        check_folder(&names).map_err(|e| Error::format(uri, e))?;
        return Ok(files);
    }
    if path.extension().is_some_and(|e| e == "json") {
        return index_files(&path);
    }
    Ok(vec![path])
}

/// Turns the user's local URIs into the list of files to load, in a stable order, each once.
pub fn resolve(uris: &[String]) -> Result<Vec<PathBuf>> {
    if uris.is_empty() {
        return Err(Error::option("uri", "no file given"));
    }
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for uri in uris {
        for p in expand(uri)? {
            if seen.insert(p.clone()) {
                out.push(p);
            }
        }
    }
    Ok(out)
}
