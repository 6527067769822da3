//! `fastload copy SRC DST`: every file a source names (one file, a folder, a prefix, a Hub repo at
//! a resolved commit) to a destination folder or file, with no local staging. Each file is read
//! once, in ranged reads in parallel (the sources' own resumable reads), and its blocks go, in
//! order, into a [`Sink`] (a temporary file renamed into place, or a multipart upload completed
//! last): nothing partial is ever visible at the destination.
//!
//! - Integrity: a Hub file's sha256 (LFS) or git blob id is checked while it streams
//!   ([`VerifyingSource`]); the read that completes a file with the wrong digest fails, its
//!   sink is aborted before publishing, and the copy fails naming the file.
//! - Resumable: the source's identity ([`Item::id`]) is stored with each published file (object
//!   metadata `fastload-source`; a local file's `user.fastload_source` extended attribute),
//!   marked unchecked when the source has a digest that was not checked on the way
//!   (`verify=False`, [`done::record`]); a rerun skips a destination file of the same size and
//!   identity (a local one without the attribute is hashed when the source has a digest), except
//!   that a `verify=True` run checks an unchecked copy again (hashes a local file, copies an
//!   object again). An existing file that is not a copy of the source is refused unless
//!   `overwrite`, which copies every file again. So is an earlier checkpoint of another layout
//!   that the copy would leave beside its files ([`refuse_other_layouts`]).
//! - Overwriting: every file is copied again, each held back complete and unpublished until all
//!   are, then published (stage.rs: the indexes last, or first where nothing earlier is left to
//!   load): a failed or interrupted copy leaves
//!   the earlier files or none, never some of each. The earlier checkpoint files the copy does
//!   not replace (`fastload.save`'s rule, [`stage::stale`]) are removed first.
//! - Several files at once ([`MAX_FILES_IN_FLIGHT`]), indexes first, then the largest (see
//!   [`schedule`]): a resuming copy stopped at any point leaves an index naming shards not yet
//!   there, never shards alone.
//! - Groups: with `world > 1` each rank copies its share of the files (balanced by size, the same
//!   split on every rank); with an [`Exchange`] between the ranks, a file of at least two parts
//!   per rank going to S3 or GCS is split into part ranges that every rank uploads (split.rs),
//!   and an overwriting copy publishes every rank's files together (together.rs). Ranks without
//!   an exchange are refused an overwriting copy: they could only publish each its own share.
//! - Names from the listing go through [`crate::format::check_inside`] before anything is written.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::options::{
    DEFAULT_COPY_BLOCK_SIZE, DEFAULT_COPY_CONCURRENCY, DEFAULT_WRITE_MEMORY_LIMIT,
};
use crate::sink::{self, multipart, Sink, WriteOptions};
use crate::source::cache::verify::VerifyingSource;
use crate::source::Source;
use crate::uri::Kind;

mod done;
mod encrypted;
mod group;
mod list;
mod split;
mod stage;
mod together;

pub use done::{Existing, ID_KEY};
pub use list::{list, Item, Listing};
pub use split::Exchange;

/// What a copy reports as it goes.
#[derive(Debug, Clone)]
pub enum Event {
    /// This rank's share: files and bytes.
    Start { files: usize, bytes: u64 },
    /// Bytes of a file read and handed to its destination.
    Bytes(u64),
    /// A file published (`skipped`: it was there already, verified).
    Done {
        dst: String,
        bytes: u64,
        skipped: bool,
    },
}

/// A copy's settings.
#[derive(Clone)]
pub struct CopyOptions {
    pub write: WriteOptions,
    /// Reads in flight per file.
    pub concurrency: usize,
    pub block_size: u64,
    /// Check Hub files' sha256 / git blob id while they stream.
    pub verify: bool,
    /// This process's rank in a group of `world` copying together.
    pub rank: usize,
    pub world: usize,
    pub progress: Option<Arc<dyn Fn(Event) + Send + Sync>>,
    /// How the ranks of a group talk (an all-gather): with it, large files are split into parts
    /// across the ranks.
    pub exchange: Option<Exchange>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            write: WriteOptions::default(),
            concurrency: DEFAULT_COPY_CONCURRENCY,
            block_size: DEFAULT_COPY_BLOCK_SIZE,
            verify: true,
            rank: 0,
            world: 1,
            progress: None,
            exchange: None,
        }
    }
}

impl CopyOptions {
    /// Checks the values every front end passes as given (`options::check`, the same rules as a
    /// load's reads and a write's parts).
    fn check(&self) -> Result<()> {
        use crate::options::check;
        check("concurrency", "concurrency", self.concurrency as u64)?;
        check("block_size", "block_size", self.block_size)?;
        self.write.check()
    }
}

impl std::fmt::Debug for CopyOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyOptions")
            .field("write", &self.write)
            .field("concurrency", &self.concurrency)
            .field("block_size", &self.block_size)
            .field("verify", &self.verify)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("exchange", &self.exchange.is_some())
            .finish()
    }
}

/// What a copy did (this rank's share).
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Destinations written.
    pub copied: Vec<String>,
    /// Destinations already complete and verified.
    pub skipped: Vec<String>,
    /// Bytes read and written.
    pub bytes: u64,
    /// Another rank of the group failed (its error is raised there, and by the group on every
    /// rank): this rank stopped.
    pub stopped: Option<String>,
}

/// Copies `src` to `dst` (see the module's documentation).
pub fn copy(src: &str, dst: &str, options: &CopyOptions) -> Result<Report> {
    options.check()?;
    if options.world == 0 || options.rank >= options.world {
        return Err(Error::option(
            "rank",
            format!("rank {} of a group of {}", options.rank, options.world),
        ));
    }
    let read_only = matches!(crate::uri::kind(dst), Kind::Hub | Kind::Peer);
    if read_only || crate::uri::store(dst) == Some(crate::uri::Store::Http) {
        return Err(Error::UnsupportedUri {
            uri: crate::store::redact_uri(dst),
            message: "fastload copies to local paths, s3://, gs:// and az://".into(),
        });
    }
    if options.write.overwrite && options.world > 1 && options.exchange.is_none() {
        return Err(Error::option(
            "overwrite",
            format!(
                "an overwriting copy by a group of {} ranks needs them to talk to each other \
                 (torch.distributed initialised, or process_group=): each rank publishing its \
                 share on its own could leave two checkpoints mixed",
                options.world
            ),
        ));
    }
    let planned = list(src, &options.write.storage_options)
        .and_then(|listing| destinations(&listing, dst))
        .and_then(|targets| refuse_other_layouts(targets, options))
        .map(|targets| {
            let split: Vec<usize> = (0..targets.len())
                .filter(|&i| split::splits(&targets[i].0, &targets[i].1, options))
                .collect();
            (targets, split)
        });
    let staged = options.write.overwrite.then(stage::Staged::default);
    match (&options.exchange, options.world > 1) {
        (Some(exchange), true) => group::in_group(planned, options, exchange, staged),
        _ => {
            let (targets, _) = planned?;
            start(&targets, &[], options);
            let outcomes = match (whole(&targets, &[], options, staged.as_ref()), staged) {
                (Err(e), staged) => {
                    abort(staged);
                    return Err(e);
                }
                (Ok(outcomes), Some(staged)) => {
                    let all: Vec<&str> = targets.iter().map(|(_, to)| to.as_str()).collect();
                    staged.publish(&all, options)?;
                    outcomes
                }
                (Ok(outcomes), None) => outcomes,
            };
            Ok(tally(&targets, &outcomes, Report::default()))
        }
    }
}

/// The files a copy lists (with their destinations) and the indices of those split into parts
/// across the ranks, or why they could not be listed.
type Planned = Result<(Vec<(Item, String)>, Vec<usize>)>;

/// A resuming copy's targets, or [`Error::Exists`] naming an earlier checkpoint file of another
/// layout at the destination ([`stage::stale`]: one `model.safetensors` where the copy writes
/// `model-*-of-*` shards, or the reverse), which the copy would leave beside its own files: a
/// reader would then load one or the other (transformers prefers the single file, vLLM the
/// index), or both. An overwriting copy removes them ([`stage::Staged::publish`]).
fn refuse_other_layouts(
    targets: Vec<(Item, String)>,
    options: &CopyOptions,
) -> Result<Vec<(Item, String)>> {
    if options.write.overwrite {
        return Ok(targets);
    }
    let all: Vec<&str> = targets.iter().map(|(_, to)| to.as_str()).collect();
    match stage::stale_files(&all, &options.write)?.into_iter().next() {
        Some(path) => Err(Error::Exists { path }),
        None => Ok(targets),
    }
}

/// Gives up an overwriting copy's staged files, if any.
fn abort(staged: Option<stage::Staged>) {
    if let Some(staged) = staged {
        staged.abort()
    }
}

/// This rank's share of the files not in `split` (copied whole), less a resuming group's indexes
/// ([`group::ahead_of_group`]).
fn whole_share(targets: &[(Item, String)], split: &[usize], options: &CopyOptions) -> Vec<usize> {
    let ahead = group::ahead_of_group(targets, options);
    let candidates: Vec<usize> = (0..targets.len())
        .filter(|i| !split.contains(i) && !ahead.contains(i))
        .collect();
    share(targets, &candidates, options.rank, options.world)
}

/// Announces this rank's share: its whole files, and its parts of the split files (whose files
/// rank 0 counts).
fn start(targets: &[(Item, String)], split: &[usize], options: &CopyOptions) {
    let mine = whole_share(targets, split, options);
    let parts: u64 = split
        .iter()
        .map(|&i| split::my_bytes(targets[i].0.source.size(), options))
        .sum();
    let split_files = if options.rank == 0 { split.len() } else { 0 };
    emit(
        options,
        Event::Start {
            files: mine.len() + split_files,
            bytes: mine
                .iter()
                .map(|&i| targets[i].0.source.size())
                .sum::<u64>()
                + parts,
        },
    );
}

/// Copies this rank's share of the files not in `split`, whole (with `staged`, an overwriting
/// copy, each added there unpublished): each file's outcome ([`copy_one`]'s, `None` for the
/// files of other ranks).
fn whole(
    targets: &[(Item, String)],
    split: &[usize],
    options: &CopyOptions,
    staged: Option<&stage::Staged>,
) -> Result<Vec<Option<bool>>> {
    let mine = whole_share(targets, split, options);
    let (indexes, rest) = schedule(targets, &mine);
    let outcomes = Mutex::new(vec![None; targets.len()]);
    run(targets, &indexes, options, &outcomes, staged)?;
    run(targets, &rest, options, &outcomes, staged)?;
    Ok(outcomes.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// `report` with this rank's whole files added, by their `outcomes` ([`whole`]: `None` for the
/// files this rank did not copy).
fn tally(targets: &[(Item, String)], outcomes: &[Option<bool>], mut report: Report) -> Report {
    for ((item, to), outcome) in targets.iter().zip(outcomes) {
        match outcome {
            Some(true) => report.skipped.push(to.clone()),
            Some(false) => {
                report.copied.push(to.clone());
                report.bytes += item.source.size();
            }
            None => {}
        }
    }
    report
}

fn emit(options: &CopyOptions, event: Event) {
    if let Some(p) = &options.progress {
        p(event)
    }
}

/// The order this rank copies its files in: the indexes (`*.index.json`) before all the others,
/// so that a resuming copy stopped at any point leaves an index naming shards not yet there (a
/// load raises), never shards without their index, which a reader taking every `*.safetensors`
/// file would load as a smaller model; then the largest first (the long transfers start early,
/// the small files fill in beside them). An overwriting copy publishes in its own order
/// ([`stage::Staged::publish`]).
fn schedule(targets: &[(Item, String)], mine: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let (indexes, mut rest): (Vec<usize>, Vec<usize>) =
        mine.iter().partition(|&&i| stage::is_index(&targets[i].1));
    rest.sort_by_key(|&i| std::cmp::Reverse(targets[i].0.source.size()));
    (indexes, rest)
}

/// Files copied at once, at most: enough that one file's fixed costs (the check of what is at the
/// destination, the first part waiting for its reads, completing the upload) overlap the others'
/// transfers, so that a folder of many files moves at the link's rate.
pub const MAX_FILES_IN_FLIGHT: usize = 4;

/// How many of `count` files are copied at once: each keeps at least two upload parts going
/// within its share of the memory limit.
fn files_in_flight(count: usize, write: &WriteOptions) -> usize {
    let limit = write.memory_limit.unwrap_or(DEFAULT_WRITE_MEMORY_LIMIT);
    let part = multipart::part_size(write, 0);
    let by_memory = usize::try_from(limit / (2 * part)).unwrap_or(usize::MAX);
    count.min(MAX_FILES_IN_FLIGHT).min(by_memory).max(1)
}

/// Copies the files `order` names, several at once (the calling thread and up to
/// [`MAX_FILES_IN_FLIGHT`]` - 1` more, each taking the next file when it is done with one; the
/// memory limit shared between them). The first failure stops the others: files in flight are
/// aborted (nothing published), files not started are left; that failure is returned. A Ctrl-C
/// (the caller's installed [`crate::runtime::Abort`]) reaches every thread.
fn run(
    targets: &[(Item, String)],
    order: &[usize],
    options: &CopyOptions,
    outcomes: &Mutex<Vec<Option<bool>>>,
    staged: Option<&stage::Staged>,
) -> Result<()> {
    if order.is_empty() {
        return Ok(());
    }
    let files = files_in_flight(order.len(), &options.write);
    let mut each = options.clone();
    if files > 1 {
        let limit = options
            .write
            .memory_limit
            .unwrap_or(DEFAULT_WRITE_MEMORY_LIMIT);
        each.write.memory_limit = Some(limit / files as u64);
    }
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let abort = crate::runtime::Abort::installed();
    let work = || {
        if let Some(a) = &abort {
            a.install();
        }
        while !stop.load(Ordering::SeqCst) {
            let Some(&i) = order.get(next.fetch_add(1, Ordering::SeqCst)) else {
                break;
            };
            match copy_one(&targets[i], &each, &stop, staged) {
                Ok(skipped) => {
                    outcomes.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(skipped);
                }
                Err(e) => {
                    let mut first = failed.lock().unwrap_or_else(|e| e.into_inner());
                    if first.is_none() {
                        *first = Some(e);
                    }
                    stop.store(true, Ordering::SeqCst);
                    break;
                }
            }
        }
    };
    std::thread::scope(|s| {
        for n in 1..files {
            // A thread that cannot start leaves its files to the others.
            let _ = std::thread::Builder::new()
                .name(format!("fastload-copy-{n}"))
                .spawn_scoped(s, work);
        }
        work();
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One file: copied again whatever is there when overwriting; else skipped when the destination
/// is a copy of this source already (`Ok(true)`: verified, or unchecked and not to be checked
/// now), copied again when it is an unchecked copy that fails the check (or cannot be checked in
/// place), refused when it holds something else, else copied (`Ok(false)`). With `staged` (an
/// overwriting copy) the file is added there complete but unpublished.
fn copy_one(
    (item, to): &(Item, String),
    options: &CopyOptions,
    stop: &AtomicBool,
    staged: Option<&stage::Staged>,
) -> Result<bool> {
    let size = item.source.size();
    let (check, mut write) = encrypted::target(item, &options.write)?;
    let found = match options.write.overwrite {
        true => Existing::Other,
        false => done::existing(to, &check, &write, rechecks(item, options))?,
    };
    match found {
        Existing::Done => {
            emit(
                options,
                Event::Done {
                    dst: to.clone(),
                    bytes: size,
                    skipped: true,
                },
            );
            return Ok(true);
        }
        Existing::Other if !options.write.overwrite => {
            return Err(Error::Exists { path: to.clone() })
        }
        // This copy's own earlier, unchecked file: replaced by a checked one.
        Existing::Unchecked => write.overwrite = true,
        _ => {}
    }
    let id = check
        .id
        .as_deref()
        .map(|id| done::record(id, checked(item, options)));
    let mut sink = copy_file(item, id.as_deref(), to, &write, options, stop)?;
    if let Some(staged) = staged {
        sink.prepare()?;
        staged.add(stage::File {
            to: to.clone(),
            sink,
            id,
            bytes: size,
        });
        return Ok(false);
    }
    publish(sink, to, id.as_deref())?;
    emit(
        options,
        Event::Done {
            dst: to.clone(),
            bytes: size,
            skipped: false,
        },
    );
    Ok(false)
}

/// Whether a copy of `item` checks its bytes on the way: a source with a digest under `verify`,
/// and one without (its recorded id, an ETag or a modification time, is no claim about the
/// bytes, so there is nothing to check).
fn checked(item: &Item, options: &CopyOptions) -> bool {
    item.digest.is_none() || options.verify
}

/// Whether an unchecked copy of `item` at the destination is checked again before it is skipped:
/// under `verify`, for a source with a digest.
fn rechecks(item: &Item, options: &CopyOptions) -> bool {
    item.digest.is_some() && options.verify
}

/// Each item with its destination URI; a name that would leave the destination fails the copy
/// before anything is written.
fn destinations(listing: &Listing, dst: &str) -> Result<Vec<(Item, String)>> {
    let local = crate::uri::kind(dst) == crate::uri::Kind::Local;
    let into_folder = !listing.single
        || dst.ends_with('/')
        || (local && std::path::Path::new(crate::uri::local_path(dst)).is_dir());
    if !into_folder {
        return Ok(listing
            .items
            .iter()
            .map(|item| (item.clone(), dst.to_string()))
            .collect());
    }
    let base = dst.trim_end_matches('/');
    listing
        .items
        .iter()
        .map(|item| {
            crate::format::check_inside(&item.rel).map_err(|reason| Error::UnsupportedUri {
                uri: item.source.name().to_string(),
                message: format!(
                    "its name {:?} cannot be copied under {dst}: {reason}; nothing was copied",
                    item.rel
                ),
            })?;
            Ok((item.clone(), format!("{base}/{}", item.rel)))
        })
        .collect()
}

/// The indices of the `candidates` rank `rank` of `world` copies: largest first to the least
/// loaded rank (ties to the lowest rank), the same on every rank.
fn share(
    targets: &[(Item, String)],
    candidates: &[usize],
    rank: usize,
    world: usize,
) -> Vec<usize> {
    let mut order: Vec<usize> = candidates.to_vec();
    order.sort_by_key(|&i| std::cmp::Reverse(targets[i].0.source.size()));
    let mut load = vec![0u64; world];
    let mut mine = Vec::new();
    for i in order {
        let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += targets[i].0.source.size().max(1);
        if r == rank {
            mine.push(i);
        }
    }
    mine.sort();
    mine
}

/// One file: its blocks read in parallel, written in order with `write`, `id` recorded with it;
/// returned unpublished, or aborted on any failure.
fn copy_file(
    item: &Item,
    id: Option<&str>,
    to: &str,
    write: &WriteOptions,
    options: &CopyOptions,
    stop: &AtomicBool,
) -> Result<Box<dyn Sink>> {
    let source: Arc<dyn Source> = match (&item.digest, options.verify) {
        (Some(digest), true) => Arc::new(VerifyingSource::new(item.source.clone(), digest)),
        _ => item.source.clone(),
    };
    let mut write = write.clone();
    if let Some(id) = id {
        write.metadata.push((ID_KEY.to_string(), id.to_string()));
    }
    let mut sink = sink::create(to, source.size(), &write)?;
    if let Err(e) = pump(
        &source,
        0..source.size(),
        &mut |b| sink.write(b),
        options,
        stop,
    ) {
        let _ = sink.abort();
        return Err(e);
    }
    Ok(sink)
}

/// Publishes a file [`copy_file`] wrote, recording `id` on a local one.
fn publish(sink: Box<dyn Sink>, to: &str, id: Option<&str>) -> Result<()> {
    let local = sink.is_local();
    sink.finish()?;
    if let (true, Some(id)) = (local, id) {
        done::mark_local(to, id);
    }
    Ok(())
}

/// Read tasks still running when a copy stops: aborted (their buffers freed) when dropped.
struct InFlight(VecDeque<tokio::task::JoinHandle<Result<Bytes>>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Reads the bytes `range` of `source` in blocks (`concurrency` in flight) into `write`, in
/// order; ends early (an error) when `stop` is set (another file failed).
fn pump(
    source: &Arc<dyn Source>,
    range: std::ops::Range<u64>,
    write: &mut dyn FnMut(Bytes) -> Result<()>,
    options: &CopyOptions,
    stop: &AtomicBool,
) -> Result<()> {
    let runtime = crate::runtime::try_get()?;
    let size = range.end;
    let block = options.block_size.max(1);
    let mut next = range.start;
    let mut reads = InFlight(VecDeque::new());
    loop {
        if stop.load(Ordering::SeqCst) {
            return Err(Error::Cancelled {
                what: format!("{}: another file of the copy failed", source.name()),
            });
        }
        while reads.0.len() < options.concurrency.max(1) && next < size {
            let (offset, len) = (next, block.min(size - next) as usize);
            next += len as u64;
            let src = source.clone();
            let _entered = runtime.enter();
            reads
                .0
                .push_back(crate::source::spawn_read(source.as_ref(), async move {
                    let mut buf = vec![0u8; len];
                    src.read_into(offset, &mut buf).await?;
                    Ok(Bytes::from(buf))
                }));
        }
        let Some(task) = reads.0.pop_front() else {
            break;
        };
        let name = source.name().to_string();
        let bytes =
            crate::runtime::block_on(&name, async { crate::source::joined(task.await, &name) })?;
        let n = bytes.len() as u64;
        write(bytes)?;
        emit(options, Event::Bytes(n));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::testing::Bytes as Mem;

    fn item(rel: &str, size: usize) -> Item {
        Item {
            rel: rel.into(),
            source: Arc::new(Mem {
                name: format!("mem://{rel}"),
                data: vec![7; size],
            }),
            digest: None,
            id: None,
        }
    }

    fn listing(single: bool, names: &[(&str, usize)]) -> Listing {
        Listing {
            single,
            items: names.iter().map(|&(n, s)| item(n, s)).collect(),
        }
    }

    #[test]
    fn ranks_split_the_files_by_size_and_together_cover_them_once() {
        let l = listing(
            false,
            &[
                ("a", 100),
                ("b", 90),
                ("c", 10),
                ("d", 5),
                ("e", 0),
                ("f", 80),
            ],
        );
        let t = destinations(&l, "s3://b/p/").unwrap();
        let all: Vec<usize> = (0..6).collect();
        let shares: Vec<Vec<usize>> = (0..3).map(|r| share(&t, &all, r, 3)).collect();
        let mut all: Vec<usize> = shares.concat();
        all.sort();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
        let load = |s: &Vec<usize>| s.iter().map(|&i| t[i].0.source.size()).sum::<u64>();
        assert_eq!(shares.iter().map(load).collect::<Vec<_>>(), [100, 95, 90]);
        assert_eq!(share(&t, &all, 0, 1), all);
        assert_eq!(share(&t, &[1, 2], 1, 2), [2]);
    }

    #[test]
    fn indexes_go_first_then_the_largest_files_within_the_memory_limit() {
        let l = listing(
            false,
            &[
                ("config.json", 10),
                ("model-00001-of-00002.safetensors", 500),
                ("model.safetensors.index.json", 900),
                ("model-00002-of-00002.safetensors", 700),
            ],
        );
        let t = destinations(&l, "s3://b/p/").unwrap();
        assert_eq!(schedule(&t, &[0, 1, 2, 3]), (vec![2], vec![3, 1, 0]));
        let write = |limit: u64, part: u64| WriteOptions {
            memory_limit: Some(limit),
            part_size: Some(part),
            ..WriteOptions::default()
        };
        assert_eq!(
            files_in_flight(10, &WriteOptions::default()),
            MAX_FILES_IN_FLIGHT
        );
        assert_eq!(files_in_flight(2, &WriteOptions::default()), 2);
        assert_eq!(files_in_flight(10, &write(64 << 20, 16 << 20)), 2);
        assert_eq!(files_in_flight(10, &write(16 << 20, 16 << 20)), 1);
        assert_eq!(files_in_flight(0, &WriteOptions::default()), 1);
    }

    #[test]
    fn destinations_join_relative_names_and_refuse_hostile_ones() {
        let l = listing(false, &[("config.json", 1), ("sub/w.safetensors", 1)]);
        let t = destinations(&l, "s3://b/org/repo/").unwrap();
        assert_eq!(t[0].1, "s3://b/org/repo/config.json");
        assert_eq!(t[1].1, "s3://b/org/repo/sub/w.safetensors");
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a/%2e%2e/x",
            "C:x",
            "a\\..\\x",
        ] {
            let l = listing(false, &[("ok", 1), (bad, 1)]);
            let err = destinations(&l, "/tmp/dst").unwrap_err();
            assert!(
                err.to_string().contains("nothing was copied"),
                "{bad}: {err}"
            );
        }
        // One file: the destination itself, or into a folder named with a trailing slash.
        let one = listing(true, &[("m.safetensors", 1)]);
        assert_eq!(
            destinations(&one, "s3://b/x.st").unwrap()[0].1,
            "s3://b/x.st"
        );
        assert_eq!(
            destinations(&one, "s3://b/d/").unwrap()[0].1,
            "s3://b/d/m.safetensors"
        );
    }

    #[test]
    fn a_local_folder_is_copied_then_skipped_and_a_changed_file_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("config.json"), b"{}").unwrap();
        std::fs::write(src.join("sub/w.bin"), vec![3u8; 3 << 20]).unwrap();
        let dst = dir.path().join("dst");
        let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
        let opts = CopyOptions {
            block_size: 1 << 20,
            ..CopyOptions::default()
        };
        let first = copy(s, d, &opts).unwrap();
        assert_eq!(first.copied.len(), 2);
        assert_eq!(
            std::fs::read(dst.join("sub/w.bin")).unwrap(),
            vec![3u8; 3 << 20]
        );
        // A folder linked back up is not walked (no endless recursion).
        std::os::unix::fs::symlink(&src, src.join("sub/loop")).unwrap();
        let again = copy(s, d, &opts).unwrap();
        assert_eq!((again.copied.len(), again.skipped.len()), (0, 2));
        // The source changed (a new mtime): the old copy is not taken for it.
        std::fs::write(src.join("config.json"), b"{1}").unwrap();
        let err = copy(s, d, &opts).unwrap_err();
        assert!(matches!(err, Error::Exists { .. }), "{err}");
        let opts = CopyOptions {
            write: WriteOptions {
                overwrite: true,
                ..WriteOptions::default()
            },
            ..opts
        };
        copy(s, d, &opts).unwrap();
        assert_eq!(std::fs::read(dst.join("config.json")).unwrap(), b"{1}");
    }
}
