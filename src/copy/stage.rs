//! An overwriting copy's files, published only once every one is complete.
//!
//! `overwrite` copies every file again, so a rerun has nothing to resume and a copy can hold back
//! its files: each is written complete and durable without being visible ([`Sink::prepare`]: a
//! synced temporary file, or an upload whose parts are all stored but not completed), and only
//! when all are does [`Staged::publish`] publish them, the indexes (`*.index.json`) last where an
//! earlier checkpoint stays loadable until then (readers go from it to the new one in one step),
//! first where none is left (an empty destination, or the earlier files removed, below): a
//! process killed between two publications then leaves an index naming files not yet there (a
//! load raises), never weights alone that a reader taking every `*.safetensors` file would load
//! as a smaller model. A
//! failure or Ctrl-C before then aborts every staged file and removes those published, so a
//! reader finds the earlier files, the new ones, or (see below) an error, never some of each.
//!
//! Replacing several earlier files of the same names one by one would have a moment where the
//! earlier index (or an earlier shard set without one) names some new files and some old: when
//! more than one destination file exists, they are removed first, indexes last, so a failure
//! while publishing leaves no checkpoint rather than a mixed one (as `fastload.save` does). One
//! earlier file is replaced atomically. The earlier checkpoint files of another layout, which the
//! copy does not replace (3 shards and their index under one new `model.safetensors`), are
//! removed with them ([`stale`]): left, the earlier index would decide what loads. Memory: a staged file holds no bytes (its parts are
//! uploaded, or its bytes are on disk).

use std::sync::Mutex;

use object_store::ObjectStoreExt;

use super::{done, emit, CopyOptions, Event};
use crate::error::{Error, Result};
use crate::sink::{remove, Sink, WriteOptions};

/// A file written whole, not yet published.
pub(super) struct File {
    pub to: String,
    pub sink: Box<dyn Sink>,
    /// The source's identity recorded with a local file once it is published.
    pub id: Option<String>,
    pub bytes: u64,
}

/// The staged files of one copy (this rank's share), in the order they were staged.
#[derive(Default)]
pub(super) struct Staged(Mutex<Vec<File>>);

pub(super) fn is_index(uri: &str) -> bool {
    uri.ends_with(".index.json")
}

impl Staged {
    pub fn add(&self, file: File) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(file);
    }

    /// The staged files, in the order they were staged.
    pub fn into_files(self) -> Vec<File> {
        self.0.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives up: every staged file aborted (temporary files removed, uploads aborted).
    pub fn abort(self) {
        for f in self.0.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let _ = f.sink.abort();
        }
    }

    /// Publishes every staged file, indexes last (see the module's documentation). On failure
    /// the files not yet published are aborted and those published removed; the error returned.
    /// `all`: every destination of the copy (every rank's), none of which is stale.
    pub fn publish(self, all: &[&str], options: &CopyOptions) -> Result<()> {
        let mut files = self.0.into_inner().unwrap_or_else(|e| e.into_inner());
        let write = &options.write;
        let mut published: Vec<String> = Vec::new();
        let targets: Vec<&String> = files.iter().map(|f| &f.to).collect();
        let cleared = match clear_earlier(&targets, all, write, false) {
            Ok(cleared) => cleared,
            Err(e) => {
                roll_back(files, &published, write);
                return Err(e);
            }
        };
        // Stable: the weights in the order they were staged, the indexes last, or first where
        // nothing earlier is left to load (see the module's documentation).
        files.sort_by_key(|f| is_index(&f.to) != cleared);
        let mut rest = files.into_iter();
        let outcome = publish_each(&mut rest, &mut published, options);
        if outcome.is_err() {
            roll_back(rest.collect(), &published, write);
        }
        outcome
    }
}

/// Publishes the files of `rest` in order, each added to `published`; stops at the first failure.
pub(super) fn publish_each(
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

/// Removes the destination files about to be replaced when there are several, and with them
/// the earlier checkpoint files that the copy does not replace ([`stale`]), indexes last (an
/// index naming a removed file fails a load, where files left without their index could load as
/// a smaller model); one file is replaced atomically by its new file. Removed before publishing,
/// not after: left until then, an earlier index would decide what loads once the new files are
/// published, so a removal failing would leave the earlier checkpoint loading after a copy that
/// had published the new one. With `indexes_first` (a group publishes its indexes before its
/// weights) one earlier weight file is removed too where the copy writes an index, which would
/// otherwise name it until it is replaced. `Ok(true)`: no earlier file of the targets' names or
/// checkpoints is left (there was none, or they were removed).
pub(super) fn clear_earlier<S: AsRef<str>>(
    targets: &[S],
    all: &[&str],
    write: &WriteOptions,
    indexes_first: bool,
) -> Result<bool> {
    let mut found = Vec::new();
    for to in targets {
        if exists(to.as_ref(), write)? {
            found.push(to.as_ref().to_string());
        }
    }
    let stale = stale_files(all, write)?;
    let named_early = indexes_first
        && targets.iter().any(|t| is_index(t.as_ref()))
        && found.iter().any(|f| f.ends_with(".safetensors"));
    if found.len() < 2 && stale.is_empty() && !named_early {
        return Ok(found.is_empty());
    }
    found.extend(stale);
    found.sort_by_key(|to| is_index(to));
    found.iter().try_for_each(|to| remove(to, write))?;
    Ok(true)
}

/// The stem of a checkpoint file's name: `S` of `S.safetensors`, `S-00001-of-00003.safetensors`
/// and `S.safetensors.index.json` (the names `fastload.save` and Hugging Face give them).
fn checkpoint_stem(name: &str) -> Option<&str> {
    let stem = match name.strip_suffix(".safetensors.index.json") {
        Some(stem) => stem,
        None => {
            let base = name.strip_suffix(".safetensors")?;
            shard_stem(base).unwrap_or(base)
        }
    };
    (!stem.is_empty()).then_some(stem)
}

/// `S` of a shard's `S-00001-of-00003`.
fn shard_stem(base: &str) -> Option<&str> {
    shard_parts(base).map(|(stem, _, _)| stem)
}

/// `(S, 1, 3)` of a shard's `S-00001-of-00003`.
fn shard_parts(base: &str) -> Option<(&str, u32, u32)> {
    let five_digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let (head, total) = base.rsplit_once("-of-")?;
    let (stem, nth) = head.rsplit_once('-')?;
    if !(five_digits(total) && five_digits(nth)) {
        return None;
    }
    Some((stem, nth.parse().ok()?, total.parse().ok()?))
}

/// The stems of which `written` holds a whole checkpoint: `S.safetensors`, or every shard of an
/// `S-K-of-N` set. A copy of part of a set (one shard repaired) makes nothing of its stem stale.
fn whole_stems<'a>(written: &[&'a str]) -> Vec<&'a str> {
    let mut sets: std::collections::BTreeMap<(&str, u32), std::collections::BTreeSet<u32>> =
        Default::default();
    let mut stems = Vec::new();
    for base in written
        .iter()
        .filter_map(|w| w.strip_suffix(".safetensors"))
    {
        match shard_parts(base) {
            Some((stem, k, n)) => {
                sets.entry((stem, n)).or_default().insert(k);
            }
            None if !base.is_empty() => stems.push(base),
            None => {}
        }
    }
    for ((stem, n), present) in sets {
        if (1..=n).all(|k| present.contains(&k)) {
            stems.push(stem);
        }
    }
    stems
}

/// Of the names in one folder, the earlier checkpoint files that writing `written` leaves stale:
/// a single file, shard or index of a stem that `written` holds a whole checkpoint of, that is
/// not itself written (`fastload.save`'s rule, `_publish.py`, for every stem rather than
/// `model`); weights first, indexes last. Nothing else (configs, tokenizers, other stems, the
/// rest of a set one shard of which is copied) is stale.
pub(super) fn stale<'a>(names: &[&'a str], written: &[&str]) -> Vec<&'a str> {
    let stems = whole_stems(written);
    let mut found: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !written.contains(n))
        .filter(|n| checkpoint_stem(n).is_some_and(|s| stems.contains(&s)))
        .collect();
    found.sort_by_key(|n| (is_index(n), *n));
    found
}

/// The destination's stale checkpoint files ([`stale`]), folder by folder, as URIs.
pub(super) fn stale_files(all: &[&str], write: &WriteOptions) -> Result<Vec<String>> {
    let mut folders: Vec<&str> = all
        .iter()
        .filter_map(|to| to.rsplit_once('/'))
        .map(|p| p.0)
        .collect();
    folders.sort_unstable();
    folders.dedup();
    let mut out = Vec::new();
    for folder in folders {
        let written: Vec<&str> = all
            .iter()
            .filter_map(|to| to.rsplit_once('/'))
            .filter(|(f, _)| *f == folder)
            .map(|(_, name)| name)
            .collect();
        let listed = list_names(folder, write)?;
        let names: Vec<&str> = listed.iter().map(String::as_str).collect();
        out.extend(
            stale(&names, &written)
                .into_iter()
                .map(|n| format!("{folder}/{n}")),
        );
    }
    Ok(out)
}

/// The names of the files directly in `folder` (none when it does not exist).
fn list_names(folder: &str, write: &WriteOptions) -> Result<Vec<String>> {
    if !crate::uri::is_remote(folder) {
        let path = crate::uri::local_path(folder);
        return match std::fs::read_dir(path) {
            Ok(dir) => Ok(dir
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::Io {
                path: path.to_string(),
                source: e,
            }),
        };
    }
    let remote = crate::store::open(&format!("{folder}/"), &write.storage_options)?;
    let found = crate::runtime::block_on(&remote.uri, crate::source::object::list_folder(&remote))?;
    Ok(found
        .iter()
        .filter_map(|f| f.path.as_ref().rsplit('/').next().map(str::to_string))
        .collect())
}

/// Aborts `rest` and removes `published` (on a thread of its own: the calling thread's Ctrl-C,
/// which may be what failed the copy, must not cut the clean-up short).
pub(super) fn roll_back(rest: Vec<File>, published: &[String], write: &WriteOptions) {
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
    if !crate::uri::is_remote(uri) {
        let path = crate::uri::local_path(uri);
        return Ok(std::path::Path::new(path).symlink_metadata().is_ok());
    }
    let remote = crate::store::open(uri, &write.storage_options)?;
    crate::runtime::block_on(uri, async {
        match remote.store.head(&remote.path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(crate::store::storage_error(&remote.uri, e)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{clear_earlier, stale};
    use crate::sink::WriteOptions;

    #[test]
    fn a_lone_earlier_weight_goes_before_a_group_publishes_an_index_naming_it() {
        // The destination holds one shard of an earlier set, of a name the copy writes. One
        // process replaces it in one step (its index comes last); a group, publishing its
        // index first, must not let that index name the earlier bytes: it is removed first.
        let dir = tempfile::tempdir().unwrap();
        let at = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let targets: Vec<String> = OLD_SHARDS.iter().map(|n| at(n)).collect();
        let all: Vec<&str> = targets.iter().map(String::as_str).collect();
        let lone = &targets[1];
        let write = WriteOptions::default();
        // Nothing there: nothing earlier is left (one process publishes its index first).
        assert!(clear_earlier(&all, &all, &write, false).unwrap());
        std::fs::write(lone, b"earlier").unwrap();
        assert!(!clear_earlier(&all, &all, &write, false).unwrap());
        assert!(std::path::Path::new(lone).exists());
        assert!(clear_earlier(&all, &all, &write, true).unwrap());
        assert!(!std::path::Path::new(lone).exists());
        // A lone earlier index is replaced in one step either way; so is a weight where no
        // index is written.
        std::fs::write(&targets[3], b"{}").unwrap();
        assert!(!clear_earlier(&all, &all, &write, true).unwrap());
        assert!(std::path::Path::new(&targets[3]).exists());
        std::fs::remove_file(&targets[3]).unwrap();
        std::fs::write(lone, b"earlier").unwrap();
        assert!(!clear_earlier(&all[..3], &all[..3], &write, true).unwrap());
        assert!(std::path::Path::new(lone).exists());
    }

    const OLD_SHARDS: [&str; 4] = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ];

    #[test]
    fn a_copy_of_another_layout_leaves_the_earlier_shards_then_index_stale() {
        let mut names = OLD_SHARDS.to_vec();
        names.extend(["config.json", "tokenizer.json", "README.md"]);
        // One file over 3 shards and their index: the shards first, the index last.
        let mut want = OLD_SHARDS.to_vec();
        assert_eq!(stale(&names, &["model.safetensors", "config.json"]), want);
        // 2 shards over 3: the index is replaced, not stale.
        want.pop();
        let two = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ];
        assert_eq!(stale(&names, &two), want);
        // 3 shards over one file: the one file.
        assert_eq!(
            stale(&["model.safetensors", "config.json"], &OLD_SHARDS),
            ["model.safetensors"]
        );
    }

    #[test]
    fn a_copy_of_one_shard_leaves_the_rest_of_its_set() {
        // Repairing one shard (or copying an index alone) removes nothing of the checkpoint.
        assert!(stale(&OLD_SHARDS, &["model-00002-of-00003.safetensors"]).is_empty());
        assert!(stale(&OLD_SHARDS, &["model.safetensors.index.json"]).is_empty());
        // The whole set, even without its index, replaces a single file of its stem.
        let all = &OLD_SHARDS[..3];
        assert_eq!(stale(&["model.safetensors"], all), ["model.safetensors"]);
    }

    #[test]
    fn only_checkpoint_files_of_the_stems_written_are_stale() {
        let names = [
            "other.safetensors",
            "model-extra.safetensors",
            "model-1-of-3.safetensors",
            "unet-00001-of-00002.safetensors",
            "config.json",
            ".safetensors",
        ];
        assert!(stale(&names, &["model.safetensors"]).is_empty());
        // A copy of no checkpoint file (a config alone) leaves every earlier weight alone.
        assert!(stale(&OLD_SHARDS, &["config.json"]).is_empty());
        assert_eq!(
            stale(&names, &["unet.safetensors"]),
            ["unet-00001-of-00002.safetensors"]
        );
    }
}
