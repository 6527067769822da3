//! Object stores: a file of at most one part goes up in one PUT (conditional, `PutMode::Create`,
//! unless overwriting); a larger one through object_store's multipart upload
//! ([`MultipartUpload`]), parts in parallel (a bounded number at a time), and completed last, so
//! that the object appears whole or not at all. A failure, an abort or a drop aborts the upload (no parts left behind).
//!
//! object_store has no conditional completion of a multipart upload, so without `overwrite` a
//! larger object is checked with HEAD before the upload starts and again just before it completes:
//! a writer that creates the same key between that last HEAD and the completion is overwritten.

use std::time::Duration;

use bytes::Bytes;
use object_store::{
    MultipartUpload, ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayloadMut,
};

use tokio::task::JoinSet;

use super::{WriteOptions, DEFAULT_MEMORY_LIMIT, DEFAULT_PART_SIZE, MAX_PARTS_IN_FLIGHT};
use crate::error::{Error, Result};
use crate::source::object::{open, storage_error, Remote};

/// S3's limit on parts per upload, with room to spare.
const MAX_PARTS: u64 = 9_000;

/// How long a drop waits for the abort of an upload it leaves.
const ABORT_ON_DROP: Duration = Duration::from_secs(30);

enum State {
    /// The whole object, sent with one PUT at the end.
    Single(PutPayloadMut),
    Multi(Multi),
    Done,
}

/// A multipart upload in progress. Every step borrows it, so a wait cut short (Ctrl-C ends the
/// runtime wait) leaves it here, for the abort of [`ObjectUpload`]'s drop.
struct Multi {
    upload: Box<dyn MultipartUpload>,
    /// The part being filled (chunks of the caller's buffers, not copies).
    buffer: PutPayloadMut,
    parts: JoinSet<object_store::Result<()>>,
}

impl Multi {
    fn start_part(&mut self) {
        let part = std::mem::take(&mut self.buffer).freeze();
        self.parts.spawn(self.upload.put_part(part));
    }

    /// Waits until fewer than `n` parts are uploading (0: none); the first failure ends it.
    async fn fewer_than(&mut self, n: usize) -> object_store::Result<()> {
        while !self.parts.is_empty() && self.parts.len() >= n {
            match self.parts.join_next().await {
                Some(Ok(done)) => done?,
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

    async fn abort(mut self) -> object_store::Result<()> {
        self.parts.shutdown().await;
        self.upload.abort().await
    }
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            State::Single(_) => "Single",
            State::Multi(_) => "Multi",
            State::Done => "Done",
        })
    }
}

/// An object being uploaded.
#[derive(Debug)]
pub struct ObjectUpload {
    remote: Remote,
    state: State,
    part_size: usize,
    parts_in_flight: usize,
    overwrite: bool,
    metadata: Vec<(String, String)>,
}

/// The storage options of an upload: to S3, each PUT and part carries
/// `x-amz-checksum-crc64nvme` (object_store's `checksum_algorithm`), which the store checks on
/// receipt, unless the caller chose an algorithm (`checksum_algorithm`, `AWS_CHECKSUM_ALGORITHM`).
/// CRC64NVME rather than sha256: S3 then keeps a full-object CRC64NVME of a multipart object too
/// (`x-amz-checksum-type: FULL_OBJECT`), which `verify=True` checks on reads; a multipart
/// object uploaded with sha256 has only a composite checksum of its parts. GCS and Azure get
/// their checksums from the store's HTTP client (`source::object::checksums`).
pub(super) fn with_checksum(uri: &str, options: &[(String, String)]) -> Vec<(String, String)> {
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

/// `metadata` as object_store's attributes.
pub(super) fn attributes(metadata: &[(String, String)]) -> object_store::Attributes {
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

impl ObjectUpload {
    pub fn create(uri: &str, len: u64, options: &WriteOptions) -> Result<ObjectUpload> {
        let remote = open(uri, &with_checksum(uri, &options.storage_options))?;
        if remote.is_prefix {
            return Err(Error::UnsupportedUri {
                uri: remote.uri.clone(),
                message: "names a folder (prefix); name the object to write".into(),
            });
        }
        let part_size = options
            .part_size
            .unwrap_or(DEFAULT_PART_SIZE)
            .max(len.div_ceil(MAX_PARTS))
            .max(super::MIN_PART_SIZE);
        let limit = options.memory_limit.unwrap_or(DEFAULT_MEMORY_LIMIT);
        let parts_in_flight = usize::try_from(limit / part_size)
            .map_or(MAX_PARTS_IN_FLIGHT, |n| n.clamp(1, MAX_PARTS_IN_FLIGHT));
        let part_size = usize::try_from(part_size).unwrap_or(usize::MAX);
        let multipart = len > part_size as u64;
        let state = crate::runtime::block_on(&remote.uri, async {
            if !options.overwrite {
                refuse_existing(&remote).await?;
            }
            if !multipart {
                return Ok(State::Single(PutPayloadMut::new()));
            }
            let upload = remote
                .store
                .put_multipart_opts(
                    &remote.path,
                    PutMultipartOptions {
                        attributes: attributes(&options.metadata),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| storage_error(&remote.uri, e))?;
            Ok(State::Multi(Multi {
                upload,
                buffer: PutPayloadMut::new(),
                parts: JoinSet::new(),
            }))
        })?;
        Ok(ObjectUpload {
            remote,
            state,
            part_size,
            parts_in_flight,
            overwrite: options.overwrite,
            metadata: options.metadata.clone(),
        })
    }

    pub fn uri(&self) -> &str {
        &self.remote.uri
    }

    /// Bytes per part (the most a part being filled holds).
    pub fn part_size(&self) -> usize {
        self.part_size
    }

    /// Queues `data`; each full part starts uploading at once, after waiting while
    /// `parts_in_flight` parts are still going up.
    pub fn write(&mut self, mut data: Bytes) -> Result<()> {
        let (part_size, in_flight) = (self.part_size, self.parts_in_flight);
        let uri = self.remote.uri.clone();
        let result = match &mut self.state {
            State::Single(payload) => {
                payload.push(data);
                Ok(())
            }
            State::Multi(multi) => crate::runtime::block_on(&uri, async {
                while !data.is_empty() {
                    let room = part_size - multi.buffer.content_length();
                    multi.buffer.push(data.split_to(data.len().min(room)));
                    if multi.buffer.content_length() == part_size {
                        multi
                            .fewer_than(in_flight)
                            .await
                            .map_err(|e| storage_error(&uri, e))?;
                        multi.start_part();
                    }
                }
                Ok(())
            }),
            State::Done => Err(Error::Internal {
                message: format!("{uri}: written after it was finished"),
            }),
        };
        if result.is_err() {
            self.abort_now();
        }
        result
    }

    pub fn finish(mut self) -> Result<()> {
        let remote = self.remote.clone();
        let overwrite = self.overwrite;
        let attrs = attributes(&self.metadata);
        let out = match std::mem::replace(&mut self.state, State::Done) {
            State::Single(payload) => crate::runtime::block_on(&remote.uri, async {
                let mode = if overwrite {
                    PutMode::Overwrite
                } else {
                    PutMode::Create
                };
                let opts = PutOptions {
                    mode,
                    attributes: attrs,
                    ..Default::default()
                };
                match remote
                    .store
                    .put_opts(&remote.path, payload.into(), opts)
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(object_store::Error::AlreadyExists { .. })
                    | Err(object_store::Error::Precondition { .. }) => Err(Error::Exists {
                        path: remote.uri.clone(),
                    }),
                    Err(e) => Err(storage_error(&remote.uri, e)),
                }
            }),
            State::Multi(multi) => {
                // Back in `self` while it runs: a cut-short wait leaves it to the drop's abort.
                self.state = State::Multi(multi);
                self.prepare()?;
                let State::Multi(multi) = &mut self.state else {
                    unreachable!()
                };
                let done = crate::runtime::block_on(&remote.uri, async {
                    if !overwrite {
                        refuse_existing(&remote).await?;
                    }
                    multi
                        .upload
                        .complete()
                        .await
                        .map_err(|e| storage_error(&remote.uri, e))
                });
                if done.is_ok() {
                    self.state = State::Done;
                }
                done.map(|_| ())
            }
            State::Done => Ok(()),
        };
        // On failure `self` still holds the upload, and its drop aborts it.
        out
    }

    /// Uploads every byte written so far and waits for each part to be stored, without
    /// completing the upload: nothing is visible until [`ObjectUpload::finish`] (a shard set
    /// completes its uploads only once every shard is uploaded). An object of one part, sent
    /// with one PUT when finished directly, becomes a multipart upload of that one part here.
    /// Again: nothing to do. On failure the upload is aborted.
    pub fn prepare(&mut self) -> Result<()> {
        if let State::Single(payload) = &mut self.state {
            let payload = std::mem::take(payload);
            self.state = State::Done;
            self.state = State::Multi(self.start_multi(payload)?);
        }
        let uri = self.remote.uri.clone();
        let State::Multi(multi) = &mut self.state else {
            return Ok(());
        };
        let result = crate::runtime::block_on(&uri, async {
            if multi.buffer.content_length() > 0 {
                multi.start_part();
            }
            multi
                .fewer_than(0)
                .await
                .map_err(|e| storage_error(&uri, e))
        });
        if result.is_err() {
            self.abort_now();
        }
        result
    }

    /// A multipart upload of the object, `payload` its first (and only) part, not yet sent.
    fn start_multi(&self, payload: PutPayloadMut) -> Result<Multi> {
        let remote = &self.remote;
        let attrs = attributes(&self.metadata);
        crate::runtime::block_on(&remote.uri, async {
            let upload = remote
                .store
                .put_multipart_opts(
                    &remote.path,
                    PutMultipartOptions {
                        attributes: attrs,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| storage_error(&remote.uri, e))?;
            Ok(Multi {
                upload,
                buffer: payload,
                parts: JoinSet::new(),
            })
        })
    }

    /// Aborts the multipart upload. Not cut short by a Ctrl-C (an installed
    /// [`crate::runtime::Abort`]): aborting is what the Ctrl-C asked for. Bounded by
    /// `ABORT_ON_DROP`.
    pub fn abort(mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Multi(multi) => {
                let uri = self.remote.uri.clone();
                let runtime = crate::runtime::try_get()?;
                runtime.block_on(async {
                    match tokio::time::timeout(ABORT_ON_DROP, multi.abort()).await {
                        Ok(done) => done.map_err(|e| storage_error(&uri, e)),
                        Err(_) => Err(Error::Cancelled {
                            what: format!("{uri}: aborting the multipart upload (timed out)"),
                        }),
                    }
                })
            }
            _ => Ok(()),
        }
    }

    /// Aborts the upload in place (after a failure; the state becomes `Done`).
    fn abort_now(&mut self) {
        if let State::Multi(multi) = std::mem::replace(&mut self.state, State::Done) {
            abort_detached(multi);
        }
    }
}

impl Drop for ObjectUpload {
    fn drop(&mut self) {
        self.abort_now();
    }
}

/// Aborts `multi`, waiting a bounded time for it (a dropped writer must not leave parts behind,
/// nor hang its owner on a dead server).
fn abort_detached(multi: Multi) {
    let runtime = crate::runtime::get();
    let task = runtime.spawn(async move {
        let _ = multi.abort().await;
    });
    if tokio::runtime::Handle::try_current().is_err() {
        let _ = runtime.block_on(async { tokio::time::timeout(ABORT_ON_DROP, task).await });
    }
}

/// [`Error::Exists`] when the object is there.
pub(super) async fn refuse_existing(remote: &Remote) -> Result<()> {
    match remote.store.head(&remote.path).await {
        Ok(_) => Err(Error::Exists {
            path: remote.uri.clone(),
        }),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(storage_error(&remote.uri, e)),
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
}
