//! Ranged reads into caller buffers, resuming cut-off bodies; headers.

use std::io;
use std::time::Duration;

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};

use super::errors::*;
use super::*;
use crate::error::{Error, Result};
use crate::format::{self, Header};

/// Reads and validates the header of a `size`-byte object: one request for typical shards, a
/// second one only for headers over 256 KiB.
pub async fn read_header(remote: &Remote, path: &Path, size: u64) -> Result<Header> {
    let name = remote.uri_of(path);
    let mut probe = vec![0u8; size.min(HEADER_PROBE) as usize];
    read_range_into(remote.store.as_ref(), path, 0, &mut probe, &name).await?;
    let n = format::header_len(&probe, size).map_err(|e| Error::format(&name, e))?;
    let end = (format::PREFIX_LEN + n) as usize;
    if end > probe.len() {
        let have = probe.len();
        probe.resize(end, 0);
        read_range_into(
            remote.store.as_ref(),
            path,
            have as u64,
            &mut probe[have..],
            &name,
        )
        .await?;
    }
    format::parse_header(&probe[format::PREFIX_LEN as usize..end], size)
        .map_err(|e| Error::format(&name, e))
}

/// Reads `dst.len()` bytes at `offset` with one ranged GET, copying each body chunk into `dst` as
/// it arrives. A body that breaks off is resumed from the first missing byte (object_store already
/// retried the request itself); [`MAX_STALLED_RESUMES`] resumptions in a row without progress end
/// it. A body longer than asked for, an object shorter than the range, or an object that changed
/// (ETag) between resumptions is an error.
pub async fn read_range_into(
    store: &dyn ObjectStore,
    path: &Path,
    offset: u64,
    dst: &mut [u8],
    uri: &str,
) -> Result<()> {
    let end = offset
        .checked_add(dst.len() as u64)
        .ok_or_else(|| Error::option("range", format!("offset {offset} overflows")))?;
    let mut done = 0usize;
    let mut stalled = 0u32;
    let mut last_progress = std::time::Instant::now();
    let mut etag: Option<String> = None;
    let mut backoff = Duration::from_millis(50);
    while done < dst.len() {
        let start = offset + done as u64;
        let options = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            ..Default::default()
        };
        let result = store
            .get_opts(path, options)
            .await
            .map_err(|e| storage_error(uri, e))?;
        if result.range != (start..end) {
            return Err(io_error(
                uri,
                io::ErrorKind::UnexpectedEof,
                format!(
                    "object is {} bytes, cannot read bytes {offset}..{end} (did it change while loading?)",
                    result.meta.size
                ),
            ));
        }
        match (&etag, &result.meta.e_tag) {
            (Some(a), Some(b)) if a != b => {
                return Err(io_error(
                    uri,
                    io::ErrorKind::InvalidData,
                    "object changed while it was being read (ETag differs)",
                ))
            }
            (None, Some(b)) => etag = Some(b.clone()),
            _ => {}
        }
        let before = done;
        let mut body = result.into_stream();
        let mut cut = None;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(chunk) => {
                    let room = dst.len() - done;
                    if chunk.len() > room {
                        return Err(io_error(
                            uri,
                            io::ErrorKind::InvalidData,
                            format!(
                                "server sent more than the {} bytes asked for at offset {offset}",
                                dst.len()
                            ),
                        ));
                    }
                    dst[done..done + chunk.len()].copy_from_slice(&chunk);
                    done += chunk.len();
                }
                Err(e) => {
                    cut = Some(storage_error(uri, e));
                    break;
                }
            }
        }
        if done == dst.len() {
            break;
        }
        if done > before {
            stalled = 0;
            last_progress = std::time::Instant::now();
        } else {
            stalled += 1;
        }
        // object_store already retried inside `get_opts`; without progress for the retry budget,
        // resuming again only makes a dead or stalled server cost minutes.
        if stalled >= MAX_STALLED_RESUMES || last_progress.elapsed() > RETRY_TIMEOUT {
            return Err(cut.unwrap_or_else(|| {
                io_error(
                    uri,
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "body ended after {done} of {} bytes at offset {offset}, with no progress on retrying",
                        dst.len()
                    ),
                )
            }));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    Ok(())
}
