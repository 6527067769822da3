//! An overwriting copy's files, published only once every one is complete.
//!
//! `overwrite` copies every file again, so a rerun has nothing to resume and a copy can hold back
//! its files: each is written complete and durable without being visible ([`Sink::prepare`]: a
//! synced temporary file, or an upload whose parts are all stored but not completed), and only
//! when all are does [`Staged::publish`] publish them, the indexes (`*.index.json`) last. A
//! failure or Ctrl-C before then aborts every staged file and removes those published, so a
//! reader finds the earlier files, the new ones, or (see below) an error, never some of each.
//!
//! Replacing several earlier files of the same names one by one would have a moment where the
//! earlier index (or an earlier shard set without one) names some new files and some old: when
//! more than one destination file exists, they are removed first, indexes last, so a failure
//! while publishing leaves no checkpoint rather than a mixed one (as `fastload.save` does). One
//! earlier file is replaced atomically. Memory: a staged file holds no bytes (its parts are
//! uploaded, or its bytes are on disk).

use std::sync::Mutex;

use object_store::ObjectStoreExt;

use super::{done, emit, CopyOptions, Event};
use crate::error::{Error, Result};
use crate::write::{remove, Sink, WriteOptions};

/// A file written whole, not yet published.
pub(super) struct File {
    pub to: String,
    pub sink: Sink,
    /// The source's identity recorded with a local file once it is published.
    pub id: Option<String>,
    pub bytes: u64,
}

/// The staged files of one copy (this rank's share), in the order they were staged.
#[derive(Default)]
pub(super) struct Staged(Mutex<Vec<File>>);

fn is_index(uri: &str) -> bool {
    uri.ends_with(".index.json")
}

impl Staged {
    pub fn add(&self, file: File) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(file);
    }

    /// Gives up: every staged file aborted (temporary files removed, uploads aborted).
    pub fn abort(self) {
        for f in self.0.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let _ = f.sink.abort();
        }
    }

    /// Publishes every staged file, indexes last (see the module's documentation). On failure
    /// the files not yet published are aborted and those published removed; the error returned.
    pub fn publish(self, options: &CopyOptions) -> Result<()> {
        let mut files = self.0.into_inner().unwrap_or_else(|e| e.into_inner());
        // Stable: the weights in the order they were staged, then the indexes.
        files.sort_by_key(|f| is_index(&f.to));
        let write = &options.write;
        let mut published: Vec<String> = Vec::new();
        let targets: Vec<&String> = files.iter().map(|f| &f.to).collect();
        if let Err(e) = clear_earlier(&targets, write) {
            roll_back(files, &published, write);
            return Err(e);
        }
        let mut rest = files.into_iter();
        let outcome = publish_each(&mut rest, &mut published, options);
        if outcome.is_err() {
            roll_back(rest.collect(), &published, write);
        }
        outcome
    }
}

/// Publishes the files of `rest` in order, each added to `published`; stops at the first failure.
fn publish_each(
    rest: &mut std::vec::IntoIter<File>,
    published: &mut Vec<String>,
    options: &CopyOptions,
) -> Result<()> {
    for f in rest.by_ref() {
        let (to, local) = (f.to.clone(), f.sink.is_local());
        if let Err(e) = f.sink.finish() {
            // Cut short by a Ctrl-C, a completed upload may be published anyway.
            if matches!(e, Error::Cancelled { .. }) && !local {
                published.push(to);
            }
            return Err(e);
        }
        if let (true, Some(id)) = (local, &f.id) {
            done::mark_local(&to, id);
        }
        published.push(to.clone());
        emit(
            options,
            Event::Done {
                dst: to,
                bytes: f.bytes,
                skipped: false,
            },
        );
    }
    Ok(())
}

/// Removes the destination files about to be replaced when there are several, indexes last (an
/// index naming a removed file fails a load, where files left without their index could load as
/// a smaller model); one is replaced atomically by its new file.
fn clear_earlier(targets: &[&String], write: &WriteOptions) -> Result<()> {
    let mut found = Vec::new();
    for to in targets {
        if exists(to, write)? {
            found.push(to.as_str());
        }
    }
    if found.len() < 2 {
        return Ok(());
    }
    found.sort_by_key(|to| is_index(to));
    found.into_iter().try_for_each(|to| remove(to, write))
}

/// Aborts `rest` and removes `published` (on a thread of its own: the calling thread's Ctrl-C,
/// which may be what failed the copy, must not cut the clean-up short).
fn roll_back(rest: Vec<File>, published: &[String], write: &WriteOptions) {
    std::thread::scope(|s| {
        let _ = s
            .spawn(|| {
                for f in rest {
                    let _ = f.sink.abort();
                }
                // Weights first: an index naming a missing file fails a load.
                let mut gone: Vec<&String> = published.iter().collect();
                gone.sort_by_key(|to| is_index(to));
                for to in gone {
                    let _ = remove(to, write);
                }
            })
            .join();
    });
}

/// Whether a file or object is at `uri`.
fn exists(uri: &str, write: &WriteOptions) -> Result<bool> {
    if !crate::source::open::is_remote(uri) {
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        return Ok(std::path::Path::new(path).symlink_metadata().is_ok());
    }
    let remote = crate::source::object::open(uri, &write.storage_options)?;
    crate::runtime::block_on(uri, async {
        match remote.store.head(&remote.path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(crate::source::object::storage_error(&remote.uri, e)),
        }
    })
}
