//! Object stores: a file of at most one part goes up in one PUT (conditional, `PutMode::Create`,
//! unless overwriting); a larger one through object_store's multipart upload ([`WriteMultipart`]),
//! parts in parallel, bounded by bytes in flight, and completed last, so that the object appears
//! whole or not at all. A failure, an abort or a drop aborts the upload (no parts left behind).
//!
//! object_store has no conditional completion of a multipart upload, so without `overwrite` a
//! larger object is checked with HEAD before the upload starts and again just before it completes:
//! a writer that creates the same key between that last HEAD and the completion is overwritten.

use std::time::Duration;

use bytes::Bytes;
use object_store::{
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayloadMut, WriteMultipart,
};

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
    Multi(WriteMultipart),
    Done,
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
}

impl ObjectUpload {
    pub fn create(uri: &str, len: u64, options: &WriteOptions) -> Result<ObjectUpload> {
        let remote = open(uri, &options.storage_options)?;
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
                .put_multipart_opts(&remote.path, PutMultipartOptions::default())
                .await
                .map_err(|e| storage_error(&remote.uri, e))?;
            Ok(State::Multi(WriteMultipart::new_with_chunk_size(
                upload, part_size,
            )))
        })?;
        Ok(ObjectUpload {
            remote,
            state,
            part_size,
            parts_in_flight,
            overwrite: options.overwrite,
        })
    }

    pub fn uri(&self) -> &str {
        &self.remote.uri
    }

    /// Queues `data`; each full part starts uploading at once, after waiting while
    /// `parts_in_flight` parts are still going up.
    pub fn write(&mut self, mut data: Bytes) -> Result<()> {
        match &mut self.state {
            State::Single(payload) => {
                payload.push(data);
                Ok(())
            }
            State::Multi(upload) => {
                let (part_size, in_flight) = (self.part_size, self.parts_in_flight);
                let uri = self.remote.uri.clone();
                let result = crate::runtime::block_on(&uri, async {
                    while !data.is_empty() {
                        upload
                            .wait_for_capacity(in_flight)
                            .await
                            .map_err(|e| storage_error(&uri, e))?;
                        // At most one part starts per `put`, so waiting first bounds them.
                        let chunk = data.split_to(data.len().min(part_size));
                        upload.put(chunk);
                    }
                    Ok(())
                });
                if result.is_err() {
                    self.abort_now();
                }
                result
            }
            State::Done => Err(Error::Internal {
                message: format!("{}: written after it was finished", self.remote.uri),
            }),
        }
    }

    pub fn finish(mut self) -> Result<()> {
        let state = std::mem::replace(&mut self.state, State::Done);
        let remote = self.remote.clone();
        let overwrite = self.overwrite;
        let out = crate::runtime::block_on(&remote.uri, async {
            match state {
                State::Single(payload) => {
                    let mode = if overwrite {
                        PutMode::Overwrite
                    } else {
                        PutMode::Create
                    };
                    let opts = PutOptions {
                        mode,
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
                }
                State::Multi(mut upload) => {
                    let flushed = upload
                        .wait_for_capacity(0)
                        .await
                        .map_err(|e| storage_error(&remote.uri, e));
                    let checked = match flushed {
                        Ok(()) if !overwrite => refuse_existing(&remote).await,
                        other => other,
                    };
                    if let Err(e) = checked {
                        let _ = upload.abort().await;
                        return Err(e);
                    }
                    // `finish` sends the last part, completes, and aborts when either fails.
                    upload
                        .finish()
                        .await
                        .map(|_| ())
                        .map_err(|e| storage_error(&remote.uri, e))
                }
                State::Done => Ok(()),
            }
        });
        out
    }

    pub fn abort(mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Multi(upload) => {
                let uri = self.remote.uri.clone();
                crate::runtime::block_on(&uri, async {
                    upload.abort().await.map_err(|e| storage_error(&uri, e))
                })
            }
            _ => Ok(()),
        }
    }

    /// Aborts the upload in place (after a failure; the state becomes `Done`).
    fn abort_now(&mut self) {
        if let State::Multi(upload) = std::mem::replace(&mut self.state, State::Done) {
            abort_detached(upload);
        }
    }
}

impl Drop for ObjectUpload {
    fn drop(&mut self) {
        self.abort_now();
    }
}

/// Aborts `upload`, waiting a bounded time for it (a dropped writer must not leave parts behind,
/// nor hang its owner on a dead server).
fn abort_detached(upload: WriteMultipart) {
    let runtime = crate::runtime::get();
    let task = runtime.spawn(async move {
        let _ = upload.abort().await;
    });
    if tokio::runtime::Handle::try_current().is_err() {
        let _ = runtime.block_on(async { tokio::time::timeout(ABORT_ON_DROP, task).await });
    }
}

/// [`Error::Exists`] when the object is there.
async fn refuse_existing(remote: &Remote) -> Result<()> {
    match remote.store.head(&remote.path).await {
        Ok(_) => Err(Error::Exists {
            path: remote.uri.clone(),
        }),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(storage_error(&remote.uri, e)),
    }
}
