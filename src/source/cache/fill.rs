//! A source that writes each block it reads to the entry's partial file at the block's offset
//! (one positioned write; the bytes are never read from the network twice), and publishes the
//! file once every byte is there.
//!
//! The filler holds the entry's advisory lock (`flock`) from creating the partial file until it
//! is published or deleted: a second process loading the same object finds the lock taken and
//! reads from the network without writing (it never waits on the lock). The lock dies with its
//! process, so a partial file left by a killed process is truncated and refilled by the next
//! filler; a stream that ends early deletes its partial file when its source is dropped.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::entry::Entry;
use super::{Decorator, Run};
use crate::error::Result;
use crate::source::identity::CacheIdentity;
use crate::source::Source;

/// A remote source whose reads also fill the local copy.
#[derive(Debug)]
pub struct FillingSource {
    inner: Arc<dyn Source>,
    entry: Entry,
    run: Arc<Run>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The partial file (`None` once published, given up or failed).
    file: Option<Arc<File>>,
    /// The lock, held until the partial file is published or deleted.
    lock: Option<File>,
    covered: Covered,
}

impl FillingSource {
    /// Takes the entry's lock and creates its partial file, sized to the object; `None` when
    /// another process holds the lock (or the file cannot be made: then `run` warns once).
    pub fn start(inner: Arc<dyn Source>, entry: Entry, run: Arc<Run>) -> Option<FillingSource> {
        let lock = match try_lock(&entry.lock) {
            Ok(Some(lock)) => lock,
            Ok(None) => return None,
            Err(e) => {
                run.disable(&entry.unusable(&e));
                return None;
            }
        };
        let size = entry.identity.size;
        // Hub blobs go to `blobs/`, which the lock (under `.locks/`) did not create.
        let folder = entry.partial.parent().map(std::fs::create_dir_all);
        let file = folder
            .unwrap_or(Ok(()))
            .and_then(|()| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&entry.partial)
            })
            .and_then(|f| f.set_len(size).map(|()| f));
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                let e = std::io::Error::new(
                    e.kind(),
                    format!("cannot create {}: {e}", entry.partial.display()),
                );
                run.disable(&entry.unusable(&e));
                let _ = std::fs::remove_file(&entry.partial);
                return None;
            }
        };
        Some(FillingSource {
            inner,
            run,
            state: Mutex::new(State {
                file: Some(Arc::new(file)),
                lock: Some(lock),
                covered: Covered::default(),
            }),
            entry,
        })
    }

    /// Writes one block that was read; publishes when it was the last one missing.
    fn keep(&self, offset: u64, bytes: &[u8]) {
        let Some(file) = self.state.lock().unwrap().file.clone() else {
            return;
        };
        if self.run.disabled() {
            return self.give_up();
        }
        if let Err(e) = file.write_all_at(bytes, offset) {
            let what = format!("cannot write {}: {e}", self.entry.partial.display());
            self.run.disable(&what);
            return self.give_up();
        }
        self.run.add_filled(bytes.len() as u64);
        let mut state = self.state.lock().unwrap();
        state.covered.add(offset, offset + bytes.len() as u64);
        if state.file.is_none() || state.covered.len() < self.entry.identity.size {
            return;
        }
        // The source's version now must be the one the entry was opened for: a source that
        // saw the object change (another ETag, size) while reading publishes nothing.
        let now = self.inner.cache_identity();
        let same = now.as_ref().is_some_and(|now| {
            let was = &self.entry.identity;
            (&now.uri, now.size, &now.etag, &now.sha256)
                == (&was.uri, was.size, &was.etag, &was.sha256)
        });
        if !same {
            drop(state);
            self.run.warn(&format!(
                "{}: not cached: the object changed while it was read",
                self.entry.identity.uri
            ));
            return self.give_up();
        }
        let file = state.file.take().expect("checked above");
        let lock = state.lock.take();
        let (entry, run) = (self.entry.clone(), self.run.clone());
        // Flushing the copy to disk and hashing it back take as long as the load itself: on a
        // thread of their own, which the load does not wait for (`super::wait_published` does).
        super::publishing(std::thread::spawn(move || {
            match entry.verify_and_publish(&file) {
                Ok(()) => run.add_published(),
                Err(why) => run.warn(&format!("{}: not cached: {why}", entry.identity.uri)),
            }
            drop(lock);
        }));
    }

    /// Stops filling this object: the partial file is deleted, then the lock released.
    fn give_up(&self) {
        let mut state = self.state.lock().unwrap();
        if state.file.take().is_some() {
            let _ = std::fs::remove_file(&self.entry.partial);
        }
        state.lock = None;
    }
}

impl Drop for FillingSource {
    fn drop(&mut self) {
        self.give_up();
    }
}

impl Decorator for FillingSource {
    fn inner(&self) -> &dyn Source {
        self.inner.as_ref()
    }

    fn after_read(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.keep(offset, bytes);
        Ok(())
    }

    /// A block that failed (an object that changed while loading above all: its other blocks
    /// may be of either version) abandons the copy: nothing published.
    fn read_failed(&self) {
        self.give_up();
    }

    fn identity(&self) -> Option<CacheIdentity> {
        Some(self.entry.identity.clone())
    }
}

/// `flock(LOCK_EX | LOCK_NB)` on `path` (created with its folders): the same lock
/// huggingface_hub's `filelock` takes on its `.lock` files. `Ok(None)` when another process holds
/// it (`EWOULDBLOCK`); any other failure (a cache directory that is a file, under a file,
/// `/dev/null`, on a read-only filesystem) is the error, for the caller to report.
pub(crate) fn try_lock(path: &Path) -> std::io::Result<Option<File>> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot create {}: {e}", parent.display()))
        })?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
        })?;
    loop {
        #[allow(unsafe_code)]
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(Some(file));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(None),
            Some(libc::EINTR) => continue,
            _ => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("cannot lock {}: {e}", path.display()),
                ))
            }
        }
    }
}

/// The byte ranges written so far, merged.
#[derive(Debug, Default)]
struct Covered {
    /// Sorted, disjoint, non-adjacent `[begin, end)` ranges.
    ranges: Vec<(u64, u64)>,
}

impl Covered {
    fn add(&mut self, begin: u64, end: u64) {
        if begin >= end {
            return;
        }
        let (mut begin, mut end) = (begin, end);
        let mut kept = Vec::with_capacity(self.ranges.len() + 1);
        for &(b, e) in &self.ranges {
            if e < begin || b > end {
                kept.push((b, e));
            } else {
                begin = begin.min(b);
                end = end.max(e);
            }
        }
        let at = kept.partition_point(|&(b, _)| b < begin);
        kept.insert(at, (begin, end));
        self.ranges = kept;
    }

    fn len(&self) -> u64 {
        self.ranges.iter().map(|(b, e)| e - b).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covered_ranges_merge_whatever_the_order() {
        let mut c = Covered::default();
        c.add(10, 20);
        c.add(0, 5);
        c.add(5, 10);
        assert_eq!(c.ranges, vec![(0, 20)]);
        c.add(15, 30);
        c.add(40, 50);
        c.add(0, 3);
        assert_eq!(c.ranges, vec![(0, 30), (40, 50)]);
        assert_eq!(c.len(), 40);
        c.add(30, 40);
        assert_eq!(c.ranges, vec![(0, 50)]);
    }

    #[test]
    fn a_held_lock_is_refused_to_a_second_holder_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b.lock");
        let first = try_lock(&path).unwrap().unwrap();
        assert!(try_lock(&path).unwrap().is_none());
        drop(first);
        assert!(try_lock(&path).unwrap().is_some());
        // Anything but "held by another" is an error naming the path and the OS error.
        let file = dir.path().join("f");
        std::fs::write(&file, b"").unwrap();
        let err = try_lock(&file.join("x.lock")).unwrap_err().to_string();
        assert!(err.contains("File exists") && err.contains("/f"), "{err}");
    }
}
