//! The one multipart upload: parts of [`part_size`] bytes filled from the caller's buffers (no
//! copies), uploaded in parallel ([`parts_in_flight`] at a time), completed last so that the
//! object appears whole or not at all. Two ways to use it:
//!
//! - [`MultipartSink`], a [`Sink`]: one process writes the whole object through object_store's
//!   [`MultipartUpload`] (which numbers the parts and completes the upload itself);
//! - [`SharedUpload`]: several processes (the ranks of a copy) write parts of one object through
//!   the store's low-level [`MultipartStore`]; each uploads its own range of part numbers
//!   ([`SharedUpload::parts`]) and one completes the upload with every rank's part ids.
//!
//! Both fill, bound and wait on their parts through one [`Parts`]. A failure, an abort or a drop
//! aborts the upload (no parts left behind).
//!
//! object_store has no conditional completion of a multipart upload, so without `overwrite` the
//! object is checked with HEAD before the upload starts and again just before it completes: a
//! writer that creates the same key between that last HEAD and the completion is overwritten.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{MultipartUpload, ObjectStoreExt, PutMultipartOptions, PutPayloadMut};
use tokio::task::JoinSet;

use super::{Sink, WriteOptions};
use crate::error::{Error, Result};
use crate::options::{
    DEFAULT_PART_SIZE, DEFAULT_WRITE_MEMORY_LIMIT, MAX_PARTS_IN_FLIGHT, MIN_PART_SIZE,
};
use crate::store::{open, storage_error, Remote};

/// S3's limit on parts per upload, with room to spare.
pub const MAX_PARTS: u64 = 9_000;

/// How long aborting an upload may take (a dropped writer must not leave parts behind, nor hang
/// its owner on a dead server).
const ABORT: Duration = Duration::from_secs(30);

/// Bytes per part of an object of `len` bytes: the chosen size (else [`DEFAULT_PART_SIZE`]), at
/// least the stores' smallest part, raised as needed to stay within [`MAX_PARTS`].
pub fn part_size(options: &WriteOptions, len: u64) -> u64 {
    options
        .part_size
        .unwrap_or(DEFAULT_PART_SIZE)
        .max(MIN_PART_SIZE)
        .max(len.div_ceil(MAX_PARTS))
}

/// Parts of `part_size` bytes in flight at once: as many as the memory limit holds (else
/// [`DEFAULT_WRITE_MEMORY_LIMIT`]'s), at least one, at most [`MAX_PARTS_IN_FLIGHT`].
pub fn parts_in_flight(options: &WriteOptions, part_size: u64) -> usize {
    let limit = options.memory_limit.unwrap_or(DEFAULT_WRITE_MEMORY_LIMIT);
    usize::try_from(limit / part_size.max(1))
        .map_or(MAX_PARTS_IN_FLIGHT, |n| n.clamp(1, MAX_PARTS_IN_FLIGHT))
}

/// The storage options of an upload: to S3, each PUT and part carries
/// `x-amz-checksum-crc64nvme` (object_store's `checksum_algorithm`), which the store checks on
/// receipt, unless the caller chose an algorithm (`checksum_algorithm`, `AWS_CHECKSUM_ALGORITHM`).
/// CRC64NVME rather than sha256: S3 then keeps a full-object CRC64NVME of a multipart object too
/// (`x-amz-checksum-type: FULL_OBJECT`), which `verify=True` checks on reads; a multipart
/// object uploaded with sha256 has only a composite checksum of its parts. GCS and Azure get
/// their checksums from the store's HTTP client (`store::checksums`).
pub(crate) fn with_checksum(uri: &str, options: &[(String, String)]) -> Vec<(String, String)> {
    let mut out = options.to_vec();
    let s3 = crate::uri::store(uri) == Some(crate::uri::Store::S3);
    let chosen = options.iter().any(|(k, _)| {
        let k = k.to_ascii_lowercase();
        k == "checksum_algorithm" || k == "aws_checksum_algorithm"
    }) || std::env::var_os("AWS_CHECKSUM_ALGORITHM").is_some();
    if s3 && !chosen {
        out.push(("aws_checksum_algorithm".into(), "crc64nvme".into()));
    }
    out
}

/// Opens `uri` for an upload (with [`with_checksum`]'s settings); a prefix is refused.
pub(crate) fn open_object(uri: &str, options: &WriteOptions) -> Result<Remote> {
    let remote = open(uri, &with_checksum(uri, &options.storage_options))?;
    if remote.is_prefix {
        return Err(Error::UnsupportedUri {
            uri: remote.uri.clone(),
            message: "names a folder (prefix); name the object to write".into(),
        });
    }
    Ok(remote)
}

/// `metadata` as object_store's attributes.
pub(crate) fn attributes(metadata: &[(String, String)]) -> object_store::Attributes {
    metadata
        .iter()
        .map(|(k, v)| {
            (
                object_store::Attribute::Metadata(k.clone().into()),
                object_store::AttributeValue::from(v.clone()),
            )
        })
        .collect()
}

/// [`Error::Exists`] when the object is there.
pub(crate) async fn refuse_existing(remote: &Remote) -> Result<()> {
    match remote.store.head(&remote.path).await {
        Ok(_) => Err(Error::Exists {
            path: remote.uri.clone(),
        }),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(storage_error(&remote.uri, e)),
    }
}

/// `abort`, not cut short by a Ctrl-C (an installed [`crate::runtime::Abort`]: aborting is what
/// the Ctrl-C asked for), bounded by [`ABORT`].
fn abort_bounded(
    uri: &str,
    abort: impl std::future::Future<Output = object_store::Result<()>>,
) -> Result<()> {
    let runtime = crate::runtime::try_get()?;
    runtime.block_on(async {
        match tokio::time::timeout(ABORT, abort).await {
            Ok(done) => done.map_err(|e| storage_error(uri, e)),
            Err(_) => Err(Error::Cancelled {
                what: format!("{uri}: aborting the multipart upload (timed out)"),
            }),
        }
    })
}

/// Where parts go.
enum Target {
    /// object_store's upload of a whole object: it numbers the parts itself.
    Whole(Box<dyn MultipartUpload>),
    /// Parts of an upload several processes share, by number; their ids are kept.
    Shared {
        store: Arc<dyn MultipartStore>,
        path: Path,
        id: String,
    },
}

/// Parts being filled and uploaded. Every step borrows it, so a wait cut short (Ctrl-C ends the
/// runtime wait) leaves it with its owner, for the abort of the owner's drop.
pub(crate) struct Parts {
    target: Target,
    /// The part being filled (chunks of the caller's buffers, not copies).
    buffer: PutPayloadMut,
    part_size: usize,
    in_flight: usize,
    /// The number of the first part, and of the next one to start.
    first: usize,
    next: usize,
    tasks: JoinSet<object_store::Result<(usize, Option<PartId>)>>,
    /// The ids of the parts uploaded ([`Target::Shared`]), from `first` on.
    ids: Vec<Option<PartId>>,
}

impl Parts {
    fn new(target: Target, buffer: PutPayloadMut, part_size: u64, in_flight: usize) -> Parts {
        Parts {
            target,
            buffer,
            part_size: usize::try_from(part_size).unwrap_or(usize::MAX),
            in_flight,
            first: 0,
            next: 0,
            tasks: JoinSet::new(),
            ids: Vec::new(),
        }
    }

    fn start_part(&mut self) {
        let part = std::mem::take(&mut self.buffer).freeze();
        let idx = self.next;
        self.next += 1;
        match &mut self.target {
            Target::Whole(upload) => {
                let put = upload.put_part(part);
                self.tasks
                    .spawn(async move { put.await.map(|()| (idx, None)) });
            }
            Target::Shared { store, path, id } => {
                let (store, path, id) = (store.clone(), path.clone(), id.clone());
                self.tasks.spawn(async move {
                    let part = store.put_part(&path, &id, idx, part).await?;
                    Ok((idx, Some(part)))
                });
            }
        }
    }

    /// Waits until fewer than `n` parts are uploading (0: none), keeping their ids; the first
    /// failure ends it.
    async fn fewer_than(&mut self, n: usize) -> object_store::Result<()> {
        while !self.tasks.is_empty() && self.tasks.len() >= n {
            match self.tasks.join_next().await {
                Some(Ok(done)) => {
                    if let (idx, Some(part)) = done? {
                        let at = idx - self.first;
                        if self.ids.len() <= at {
                            self.ids.resize(at + 1, None);
                        }
                        self.ids[at] = Some(part);
                    }
                }
                Some(Err(e)) => {
                    return Err(object_store::Error::Generic {
                        store: "fastload",
                        source: Box::new(e),
                    })
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Queues `data`; each full part starts uploading at once, after waiting while
    /// `in_flight` parts are still going up.
    pub async fn write(&mut self, mut data: Bytes) -> object_store::Result<()> {
        while !data.is_empty() {
            let room = self.part_size - self.buffer.content_length();
            self.buffer.push(data.split_to(data.len().min(room)));
            if self.buffer.content_length() == self.part_size {
                self.fewer_than(self.in_flight).await?;
                self.start_part();
            }
        }
        Ok(())
    }

    /// Uploads what is left (a last, shorter part) and waits for every part to be stored.
    pub async fn flush(&mut self) -> object_store::Result<()> {
        if self.buffer.content_length() > 0 {
            self.start_part();
        }
        self.fewer_than(0).await
    }

    /// The ids of the parts uploaded, in order, once [`Parts::flush`] returned (`None` if one
    /// is missing).
    pub fn ids(self) -> Option<Vec<String>> {
        let want = self.next - self.first;
        let ids: Option<Vec<String>> = self
            .ids
            .into_iter()
            .map(|p| p.map(|p| p.content_id))
            .collect();
        ids.filter(|ids| ids.len() == want)
    }
}

/// A multipart upload of a whole object by this process.
pub struct MultipartSink {
    remote: Remote,
    parts: Option<Parts>,
    overwrite: bool,
}

impl std::fmt::Debug for MultipartSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MultipartSink({})", self.remote.uri)
    }
}

impl MultipartSink {
    /// Starts the upload of `remote`, `first` the bytes already given for it (an object that
    /// was to go up in one PUT, [`super::object::ObjectPut::prepare`]).
    pub(crate) fn start(
        remote: Remote,
        first: PutPayloadMut,
        options: &WriteOptions,
        part_size: u64,
    ) -> Result<MultipartSink> {
        let attrs = attributes(&options.metadata);
        let upload = crate::runtime::block_on(&remote.uri, async {
            remote
                .store
                .put_multipart_opts(
                    &remote.path,
                    PutMultipartOptions {
                        attributes: attrs,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| storage_error(&remote.uri, e))
        })?;
        let in_flight = parts_in_flight(options, part_size);
        Ok(MultipartSink {
            remote,
            parts: Some(Parts::new(
                Target::Whole(upload),
                first,
                part_size,
                in_flight,
            )),
            overwrite: options.overwrite,
        })
    }

    /// Runs `step` on the parts; on failure the upload is aborted.
    fn step<T>(
        &mut self,
        step: impl AsyncFnOnce(&mut Parts) -> object_store::Result<T>,
    ) -> Result<T> {
        let uri = self.remote.uri.clone();
        let Some(parts) = self.parts.as_mut() else {
            return Err(Error::Internal {
                message: format!("{uri}: written after it was finished"),
            });
        };
        let out = crate::runtime::block_on(&uri, async {
            step(parts).await.map_err(|e| storage_error(&uri, e))
        });
        if out.is_err() {
            self.abort_now();
        }
        out
    }

    /// Aborts the upload in place (after a failure, or dropped), waiting a bounded time for it.
    fn abort_now(&mut self) {
        let Some(parts) = self.parts.take() else {
            return;
        };
        let runtime = crate::runtime::get();
        let task = runtime.spawn(abort_parts(parts));
        if tokio::runtime::Handle::try_current().is_err() {
            let _ = runtime.block_on(async { tokio::time::timeout(ABORT, task).await });
        }
    }
}

/// Stops the parts uploading and aborts their upload ([`Target::Whole`]).
async fn abort_parts(mut parts: Parts) -> object_store::Result<()> {
    parts.tasks.shutdown().await;
    match &mut parts.target {
        Target::Whole(upload) => upload.abort().await,
        Target::Shared { .. } => Ok(()),
    }
}

impl Sink for MultipartSink {
    fn uri(&self) -> &str {
        &self.remote.uri
    }

    fn is_local(&self) -> bool {
        false
    }

    fn holds_at_most(&self) -> u64 {
        self.parts.as_ref().map_or(0, |p| p.part_size as u64)
    }

    fn write(&mut self, data: Bytes) -> Result<()> {
        self.step(async |parts| parts.write(data).await)
    }

    /// Uploads every byte written so far and waits for each part to be stored, without
    /// completing the upload: nothing is visible until [`Sink::finish`] (a shard set completes
    /// its uploads only once every shard is uploaded). Again: nothing to do.
    fn prepare(&mut self) -> Result<()> {
        self.step(async |parts| parts.flush().await)
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        self.prepare()?;
        let (remote, overwrite) = (self.remote.clone(), self.overwrite);
        let Some(Parts {
            target: Target::Whole(upload),
            ..
        }) = self.parts.as_mut()
        else {
            return Ok(());
        };
        let done = crate::runtime::block_on(&remote.uri, async {
            if !overwrite {
                refuse_existing(&remote).await?;
            }
            upload
                .complete()
                .await
                .map_err(|e| storage_error(&remote.uri, e))
        });
        if done.is_ok() {
            self.parts = None;
        }
        // On failure `self` still holds the upload, and its drop aborts it.
        done.map(|_| ())
    }

    fn abort(mut self: Box<Self>) -> Result<()> {
        match self.parts.take() {
            Some(parts) => abort_bounded(&self.remote.uri, abort_parts(parts)),
            None => Ok(()),
        }
    }
}

impl Drop for MultipartSink {
    fn drop(&mut self) {
        self.abort_now();
    }
}

/// A multipart upload that several processes write parts of ([`MultipartStore`]): one creates
/// it ([`SharedUpload::create`]), the others open it by its id ([`SharedUpload::open`]); each
/// uploads its own parts ([`SharedUpload::parts`]), and one completes it with every part's id.
pub struct SharedUpload {
    remote: Remote,
    store: Arc<dyn MultipartStore>,
    id: String,
}

impl SharedUpload {
    /// Opens `to`, with the same store settings as [`MultipartSink`] (S3 parts carry their
    /// CRC64NVME; GCS's crc32c comes from the store's client), for the upload `id`.
    pub fn open(to: &str, options: &WriteOptions, id: String) -> Result<SharedUpload> {
        let remote = open(to, &with_checksum(to, &options.storage_options))?;
        let store = remote
            .multipart
            .clone()
            .map(|m| m.0)
            .ok_or_else(|| Error::UnsupportedUri {
                uri: remote.uri.clone(),
                message: "this store has no multipart API to split a file across ranks".into(),
            })?;
        Ok(SharedUpload { remote, store, id })
    }

    /// Creates an upload of `to` whose object will carry `metadata`.
    pub fn create(
        to: &str,
        options: &WriteOptions,
        metadata: &[(String, String)],
    ) -> Result<SharedUpload> {
        let mut upload = SharedUpload::open(to, options, String::new())?;
        let (store, remote) = (&upload.store, &upload.remote);
        upload.id = crate::runtime::block_on(&remote.uri, async {
            let opts = PutMultipartOptions {
                attributes: attributes(metadata),
                ..Default::default()
            };
            store
                .create_multipart_opts(&remote.path, opts)
                .await
                .map_err(|e| storage_error(&remote.uri, e))
        })?;
        Ok(upload)
    }

    /// The upload's id, which the other processes open it by.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The destination, for messages.
    pub fn uri(&self) -> &str {
        &self.remote.uri
    }

    /// Uploads the parts `first..` written into them: [`Parts::write`], then [`Parts::flush`]
    /// and [`Parts::ids`].
    pub(crate) fn parts(&self, first: usize, part_size: u64, options: &WriteOptions) -> Parts {
        let target = Target::Shared {
            store: self.store.clone(),
            path: self.remote.path.clone(),
            id: self.id.clone(),
        };
        let in_flight = parts_in_flight(options, part_size);
        let mut parts = Parts::new(target, PutPayloadMut::new(), part_size, in_flight);
        parts.first = first;
        parts.next = first;
        parts
    }

    /// Completes the upload with every part (refusing an object that appeared meanwhile,
    /// unless overwriting); aborts it on failure.
    pub fn complete(&self, parts: Vec<String>, overwrite: bool) -> Result<()> {
        let remote = &self.remote;
        let parts = parts
            .into_iter()
            .map(|content_id| PartId { content_id })
            .collect();
        let done = crate::runtime::block_on(&remote.uri, async {
            if !overwrite {
                refuse_existing(remote).await?;
            }
            self.store
                .complete_multipart(&remote.path, &self.id, parts)
                .await
                .map_err(|e| storage_error(&remote.uri, e))
        });
        if done.is_err() {
            let _ = self.abort();
        }
        done.map(|_| ())
    }

    /// Aborts the upload.
    pub fn abort(&self) -> Result<()> {
        let abort = self.store.abort_multipart(&self.remote.path, &self.id);
        abort_bounded(&self.remote.uri, abort)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_uploads_carry_crc64nvme_checksums_unless_told_otherwise() {
        let added = (
            "aws_checksum_algorithm".to_string(),
            "crc64nvme".to_string(),
        );
        assert!(with_checksum("s3://b/k", &[]).contains(&added));
        assert!(with_checksum("S3A://b/k", &[]).contains(&added));
        let chosen = [("checksum_algorithm".to_string(), "sha256".to_string())];
        assert_eq!(with_checksum("s3://b/k", &chosen), chosen);
        assert_eq!(with_checksum("gs://b/k", &[]), []);
        assert_eq!(with_checksum("az://c/k", &[]), []);
    }

    #[test]
    fn parts_grow_to_fit_the_part_limit_and_stay_within_the_memory_limit() {
        let min = MIN_PART_SIZE;
        let mut options = WriteOptions::default();
        assert_eq!(part_size(&options, 1), DEFAULT_PART_SIZE);
        let huge = DEFAULT_PART_SIZE * MAX_PARTS * 3;
        assert_eq!(part_size(&options, huge), huge.div_ceil(MAX_PARTS));
        options.part_size = Some(1);
        assert_eq!(part_size(&options, 1), min);
        assert_eq!(parts_in_flight(&options, DEFAULT_PART_SIZE), 16);
        options.memory_limit = Some(1);
        assert_eq!(parts_in_flight(&options, DEFAULT_PART_SIZE), 1);
        options.memory_limit = Some(u64::MAX);
        assert_eq!(parts_in_flight(&options, min), MAX_PARTS_IN_FLIGHT);
    }
}
