//! Split files: in a group, a file of at least `2 × world` parts going to S3 or GCS is uploaded by
//! every rank together, through the store's low-level multipart API
//! ([`object_store::multipart::MultipartStore`]), so that one large file (or fewer files than
//! ranks) still keeps the whole fleet busy. The ranks talk through an [`Exchange`] (an all-gather
//! of one string per rank; the Python side passes torch.distributed's `all_gather_object`):
//!
//! 1. every rank lists the source and sends the split files it found ([`agree`]); a rank that
//!    failed stops every rank, and ranks that found different files all fail;
//! 2. per split file, rank 0 checks the destination (skipped when done, refused when it holds
//!    something else) and creates the upload, with the source's identity in its metadata (the
//!    mark a rerun skips it by); the upload id goes to every rank;
//! 3. each rank reads its contiguous range of parts (each source byte read once in all) and
//!    uploads them with their part numbers; the part ids (ETags) are all-gathered;
//! 4. rank 0 completes the upload with every rank's parts in order, or aborts it when any rank
//!    failed; the outcome goes to every rank.
//!
//! In an overwriting copy rank 0 does not complete the upload at step 4: it stages it
//! ([`Completing`]) beside its other files, and the group publishes them together (together.rs).
//!
//! A rank whose own step failed returns that error; the others stop with [`Stopped`] and the
//! caller's group raises the failing rank's error on every rank. Nothing is published unless every
//! part of every rank went up, and a failed file's upload is aborted (none left open).
//!
//! Not split: files encrypted on their way (the stream is sequential), Hub files checked in flight
//! (`verify`: the digest needs the whole file in order; with `verify=False` they are split), and
//! destinations other than S3 and GCS (Azure's block uploads take no metadata when created, so a
//! rerun could not recognise the copy; local files): those go whole to one rank, as before.

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;

use super::stage::{self, Staged};
use super::{done, emit, encrypted, pump, CopyOptions, Event, Existing, Item, Report};
use crate::error::{Error, Result};
use crate::sink::multipart::{self, SharedUpload};
use crate::sink::Sink;
use crate::source::Source;
use crate::store::storage_error;
use crate::uri::Store;

/// An all-gather across the group: this rank's string in, every rank's out (in rank order).
pub type Exchange = Arc<dyn Fn(String) -> Result<Vec<String>> + Send + Sync>;

/// Another rank failed (its error is raised by the group); this rank stopped.
#[derive(Debug)]
pub struct Stopped(pub String);

/// Bytes per part of a split file of `size` bytes (the multipart upload's rule).
pub(super) fn part_size(size: u64, options: &CopyOptions) -> u64 {
    multipart::part_size(&options.write, size)
}

/// Whether `item`, going to `to`, is split across the ranks (see the module's documentation).
pub(super) fn splits(item: &Item, to: &str, options: &CopyOptions) -> bool {
    let store = matches!(crate::uri::store(to), Some(Store::S3 | Store::Gcs));
    let size = item.source.size();
    options.world > 1
        && options.exchange.is_some()
        && store
        && !super::stage::is_index(to)
        && options.write.encryption.is_none()
        && !(options.verify && item.digest.is_some())
        && size >= 2 * options.world as u64 * part_size(size, options)
}

/// The bytes of a split file of `size` bytes that this rank reads and uploads.
pub(super) fn my_bytes(size: u64, options: &CopyOptions) -> u64 {
    let part_size = part_size(size, options);
    let parts = usize::try_from(size.div_ceil(part_size)).unwrap_or(usize::MAX);
    range_bytes(
        &my_parts(parts, options.rank, options.world),
        part_size,
        size,
    )
}

/// The parts (indexes from 0) rank `rank` of `world` uploads of a file of `parts` parts: a
/// contiguous range, the ranges of all ranks covering every part once.
pub(super) fn my_parts(parts: usize, rank: usize, world: usize) -> Range<usize> {
    parts * rank / world..parts * (rank + 1) / world
}

/// Step 1: every rank's plan (the split files: destination and size, or this rank's failure to
/// list) compared. `Err(Stopped)`: a rank failed to plan (this one included: the caller returns
/// its own error then); `Ok(false)`: the ranks disagree.
pub(super) fn agree(
    planned: std::result::Result<Vec<(String, u64)>, String>,
    exchange: &Exchange,
) -> Result<std::result::Result<bool, Stopped>> {
    let mine = match planned {
        Ok(files) => format!(
            "plan:{}",
            serde_json::to_string(&files).unwrap_or_else(|e| e.to_string())
        ),
        Err(e) => format!("err:{e}"),
    };
    let all = exchange(mine.clone())?;
    if let Some(stopped) = failure(&all) {
        return Ok(Err(stopped));
    }
    Ok(Ok(all.iter().all(|p| *p == mine)))
}

/// The first rank's failure in `all` (messages `err:...`).
pub(super) fn failure(all: &[String]) -> Option<Stopped> {
    all.iter().enumerate().find_map(|(r, m)| {
        m.strip_prefix("err:")
            .map(|e| Stopped(format!("rank {r} of {}: {e}", all.len())))
    })
}

/// Steps 2 to 4 for each of `files` (in that order, all ranks together). Adds this rank's share to
/// `report`. With `staged` (an overwriting copy) rank 0 stages each upload there, complete but
/// not completed.
pub(super) fn run(
    files: &[&(Item, String)],
    options: &CopyOptions,
    exchange: &Exchange,
    stop: &AtomicBool,
    report: &mut Report,
    staged: Option<&Staged>,
) -> Result<std::result::Result<(), Stopped>> {
    for (item, to) in files {
        let file = One { item, to, staged };
        if let Err(stopped) = one(&file, options, exchange, stop, report)? {
            return Ok(Err(stopped));
        }
    }
    Ok(Ok(()))
}

/// Rank 0's step 2: `None` when the destination is already a complete copy, else the upload.
fn create(item: &Item, to: &str, options: &CopyOptions) -> Result<Option<SharedUpload>> {
    let (check, write) = encrypted::target(item, &options.write)?;
    // A split file's digest is never checked on the way (see the module's documentation), so
    // there is nothing to check again either; overwriting copies again whatever is there.
    let found = match options.write.overwrite {
        true => Existing::Other,
        false => done::existing(to, &check, &write, false)?,
    };
    match found {
        Existing::Done => return Ok(None),
        Existing::Other if !options.write.overwrite => {
            return Err(Error::Exists {
                path: to.to_string(),
            })
        }
        _ => {}
    }
    let checked = item.digest.is_none();
    let metadata: Vec<(String, String)> = check
        .id
        .iter()
        .map(|id| (done::ID_KEY.to_string(), done::record(id, checked)))
        .collect();
    SharedUpload::create(to, &options.write, &metadata).map(Some)
}

fn exchanged(
    exchange: &Exchange,
    message: String,
    upload: Option<&SharedUpload>,
) -> Result<Vec<String>> {
    exchange(message).inspect_err(|_| {
        if let Some(u) = upload {
            let _ = u.abort();
        }
    })
}

/// Step 2 as this rank sees it.
enum Created {
    /// The destination is a complete copy already.
    Skip,
    /// The upload's id, with the upload itself on the rank that created it.
    Upload(String, Option<Box<SharedUpload>>),
    Stopped(Stopped),
}

/// Step 2: rank 0 creates the upload (or finds the copy done); every rank learns which.
fn created(item: &Item, to: &str, options: &CopyOptions, exchange: &Exchange) -> Result<Created> {
    let (created, message) = match (options.rank == 0).then(|| create(item, to, options)) {
        None => (None, String::new()),
        Some(Ok(None)) => (None, "skip".into()),
        Some(Ok(Some(u))) => {
            let m = format!("id:{}", u.id());
            (Some(Box::new(u)), m)
        }
        Some(Err(e)) => {
            exchange(format!("err:{e}"))?;
            return Err(e);
        }
    };
    let all = exchanged(exchange, message, created.as_deref())?;
    let first = all.first().cloned().unwrap_or_default();
    if first == "skip" {
        return Ok(Created::Skip);
    }
    Ok(match first.strip_prefix("id:") {
        Some(id) => Created::Upload(id.to_string(), created),
        None => Created::Stopped(failure(&all[..1]).unwrap_or(Stopped(first))),
    })
}

/// Reports `to` done: `bytes` this rank copied of it, or `skipped` when it was already there.
fn report_done(options: &CopyOptions, to: &str, bytes: u64, skipped: bool) {
    emit(
        options,
        Event::Done {
            dst: to.to_string(),
            bytes,
            skipped,
        },
    );
}

/// A split file, and where an overwriting copy stages it.
struct One<'a> {
    item: &'a Item,
    to: &'a str,
    staged: Option<&'a Staged>,
}

/// One split file, steps 2 to 4. Every rank makes the same three exchanges (two when the upload
/// was not created).
fn one(
    &One { item, to, staged }: &One,
    options: &CopyOptions,
    exchange: &Exchange,
    stop: &AtomicBool,
    report: &mut Report,
) -> Result<std::result::Result<(), Stopped>> {
    let size = item.source.size();
    let (id, created) = match created(item, to, options, exchange)? {
        Created::Skip => {
            if options.rank == 0 {
                report.skipped.push(to.to_string());
            }
            report_done(options, to, my_bytes(size, options), true);
            return Ok(Ok(()));
        }
        Created::Stopped(stopped) => return Ok(Err(stopped)),
        Created::Upload(id, created) => (id, created),
    };
    // Step 3: this rank's parts.
    let part_size = part_size(size, options);
    let parts = usize::try_from(size.div_ceil(part_size)).unwrap_or(usize::MAX);
    let range = my_parts(parts, options.rank, options.world);
    let opened = match created {
        Some(u) => Ok(*u),
        None => SharedUpload::open(to, &options.write, id),
    };
    let (upload, uploaded) = match opened {
        Ok(u) => {
            let done = put_parts(&item.source, &u, range.clone(), part_size, options, stop);
            (Some(u), done)
        }
        Err(e) => (None, Err(e)),
    };
    let ending = Ending {
        to,
        upload,
        parts,
        bytes: size,
        staged,
    };
    if let Err(stopped) = complete(ending, uploaded, options, exchange)? {
        return Ok(Err(stopped));
    }
    report.bytes += range_bytes(&range, part_size, size);
    if options.rank == 0 {
        report.copied.push(to.to_string());
        // A staged file is reported done when it is published.
        if staged.is_none() {
            report_done(options, to, size, false);
        }
    }
    Ok(Ok(()))
}

/// A split file at step 4: its upload (`None` where this rank could not open it), its number of
/// parts and bytes, and where an overwriting copy stages it.
struct Ending<'a> {
    to: &'a str,
    upload: Option<SharedUpload>,
    parts: usize,
    bytes: u64,
    staged: Option<&'a Staged>,
}

/// Step 3's end and step 4: every rank's part ids (or failure) gathered; rank 0 completes the
/// upload with all of them in order (or, overwriting, stages it complete but not completed), or
/// aborts it when any rank failed; every rank learns the outcome.
fn complete(
    Ending {
        to,
        upload,
        parts,
        bytes,
        staged,
    }: Ending,
    uploaded: Result<Vec<String>>,
    options: &CopyOptions,
    exchange: &Exchange,
) -> Result<std::result::Result<(), Stopped>> {
    let rank0 = options.rank == 0;
    let message = match &uploaded {
        Ok(ids) => format!(
            "ok:{}",
            serde_json::to_string(ids).unwrap_or_else(|e| e.to_string())
        ),
        Err(e) => format!("err:{e}"),
    };
    let all = exchanged(exchange, message, upload.as_ref().filter(|_| rank0))?;
    let mut failed = failure(&all);
    let ids: Vec<String> = all
        .iter()
        .flat_map(|m| {
            m.strip_prefix("ok:")
                .and_then(|j| serde_json::from_str::<Vec<String>>(j).ok())
                .unwrap_or_default()
        })
        .collect();
    if failed.is_none() && ids.len() != parts {
        failed = Some(Stopped(format!(
            "{to}: the ranks reported {} parts of {parts}",
            ids.len()
        )));
    }
    let completed = match (upload, &failed) {
        (Some(upload), None) if rank0 => Some(match staged {
            Some(staged) => {
                staged.add(stage::File {
                    to: to.to_string(),
                    sink: Box::new(Completing { upload, parts: ids }),
                    id: None,
                    bytes,
                });
                Ok(())
            }
            None => upload.complete(ids, options.write.overwrite),
        }),
        (Some(u), Some(_)) if rank0 => {
            let _ = u.abort();
            None
        }
        _ => None,
    };
    let message = match (&uploaded, &completed) {
        (Err(e), _) | (_, Some(Err(e))) => format!("err:{e}"),
        _ => "ok".into(),
    };
    let all = exchange(message)?;
    uploaded?;
    if let Some(Err(e)) = completed {
        return Err(e);
    }
    Ok(match failed.or_else(|| failure(&all)) {
        Some(stopped) => Err(stopped),
        None => Ok(()),
    })
}

/// A split file whose every part is up, its upload not completed: staged by an overwriting copy,
/// published ([`Sink::finish`]: completed) with the group's other files, or aborted.
struct Completing {
    upload: SharedUpload,
    parts: Vec<String>,
}

impl std::fmt::Debug for Completing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completing")
            .field("uri", &self.upload.uri())
            .field("parts", &self.parts.len())
            .finish()
    }
}

impl Sink for Completing {
    fn uri(&self) -> &str {
        self.upload.uri()
    }

    fn is_local(&self) -> bool {
        false
    }

    fn holds_at_most(&self) -> u64 {
        0
    }

    fn write(&mut self, _: Bytes) -> Result<()> {
        Err(Error::Internal {
            message: format!("{}: every part is up already", self.upload.uri()),
        })
    }

    fn prepare(&mut self) -> Result<()> {
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        // Overwriting: the group removed what was there, or replaces it.
        self.upload.complete(self.parts, true)
    }

    fn abort(self: Box<Self>) -> Result<()> {
        self.upload.abort()
    }
}

/// The bytes of a file of `size` bytes that the parts `range` hold.
pub(super) fn range_bytes(range: &Range<usize>, part_size: u64, size: u64) -> u64 {
    let end = (range.end as u64 * part_size).min(size);
    end.saturating_sub(range.start as u64 * part_size)
}

/// Reads the parts `parts` of `source` and uploads them (up to the memory limit's worth at a
/// time); their ids, in order.
fn put_parts(
    source: &Arc<dyn Source>,
    upload: &SharedUpload,
    parts: Range<usize>,
    part_size: u64,
    options: &CopyOptions,
    stop: &AtomicBool,
) -> Result<Vec<String>> {
    let size = source.size();
    let bytes =
        (parts.start as u64 * part_size).min(size)..(parts.end as u64 * part_size).min(size);
    let uri = upload.uri().to_string();
    let mut out = upload.parts(parts.start, part_size, &options.write);
    let mut write = |data: Bytes| -> Result<()> {
        crate::runtime::block_on(&uri, async {
            out.write(data).await.map_err(|e| storage_error(&uri, e))
        })
    };
    pump(source, bytes, &mut write, options, stop)?;
    crate::runtime::block_on(&uri, async {
        out.flush().await.map_err(|e| storage_error(&uri, e))
    })?;
    out.ids()
        .filter(|ids| ids.len() == parts.len())
        .ok_or_else(|| Error::Internal {
            message: format!("{uri}: a part of this rank was not uploaded"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_part_ranges_cover_every_part_once_in_order() {
        for parts in [4, 5, 7, 100] {
            for world in [2, 3, 4] {
                let ranges: Vec<_> = (0..world).map(|r| my_parts(parts, r, world)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[world - 1].end, parts);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                assert!(ranges.iter().all(|r| r.len() >= parts / world));
            }
        }
        let size = 10 * (5 << 20) + 7;
        let total: u64 = (0..3)
            .map(|r| range_bytes(&my_parts(11, r, 3), 5 << 20, size))
            .sum();
        assert_eq!(total, size);
    }
}
