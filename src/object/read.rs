//! Ranged reads into caller buffers, resuming cut-off bodies.

use std::io;

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResult, ObjectStore};

use super::errors::*;
use super::retry::{Decision, ResumeState, RetrySettings};
use crate::error::{Error, Result};

/// Reads `dst.len()` bytes at `offset` with one ranged GET, copying each body chunk into `dst` as
/// it arrives. A body that breaks off is resumed from the first missing byte (object_store already
/// retried the request itself) for as long as [`ResumeState`] allows; so is a body that comes in
/// below the minimum rate (the stall rule: it is cut, and its connection with it). A body longer
/// than asked for, an object shorter than the range, or an object that changed (ETag) between
/// resumptions is an error.
pub async fn read_range_into(
    store: &dyn ObjectStore,
    path: &Path,
    offset: u64,
    dst: &mut [u8],
    uri: &str,
    retry: &RetrySettings,
) -> Result<()> {
    let end = offset
        .checked_add(dst.len() as u64)
        .ok_or_else(|| Error::option("range", format!("offset {offset} overflows")))?;
    let mut resume = retry.resume_state();
    let mut etag: Option<String> = None;
    let mut done = 0usize;
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
        check_etag(&mut etag, result.meta.e_tag.as_deref(), uri)?;
        let before = done;
        let cut = match copy_body(result, dst, &mut done, &mut resume, offset, uri).await? {
            Body::Ended(cut) => cut,
            Body::Slow(Decision::Resume { wait, .. }) => {
                tokio::time::sleep(wait).await;
                continue;
            }
            Body::Slow(Decision::GiveUp { reason }) => {
                return Err(io_error(
                    uri,
                    io::ErrorKind::TimedOut,
                    format!(
                        "bytes {offset}..{end} stalled after {done} of {} bytes: {reason} \
                         (storage_options min_rate and min_rate_window set the rule)",
                        dst.len()
                    ),
                ));
            }
        };
        if done == dst.len() {
            break;
        }
        match resume.after_cut(done > before) {
            Decision::Resume { wait, .. } => tokio::time::sleep(wait).await,
            Decision::GiveUp { .. } => {
                return Err(cut.unwrap_or_else(|| {
                    io_error(
                        uri,
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "body ended after {done} of {} bytes at offset {offset}, with no progress on retrying",
                            dst.len()
                        ),
                    )
                }))
            }
        }
    }
    Ok(())
}

/// The first response's ETag, if any, must be the ETag of every resumption.
fn check_etag(first: &mut Option<String>, now: Option<&str>, uri: &str) -> Result<()> {
    match (first.as_deref(), now) {
        (Some(a), Some(b)) if a != b => Err(io_error(
            uri,
            io::ErrorKind::InvalidData,
            "object changed while it was being read (ETag differs)",
        )),
        (None, Some(b)) => {
            *first = Some(b.to_string());
            Ok(())
        }
        _ => Ok(()),
    }
}

/// How a body ended.
enum Body {
    /// It ended, complete or early; with the error that broke it off, if one did.
    Ended(Option<Error>),
    /// The stall rule cut it: what to do next.
    Slow(Decision),
}

/// Copies the body into `dst[*done..]`, advancing `done`, until it ends or a window of the stall
/// rule passes below the minimum rate; a body longer than `dst` is an error.
async fn copy_body(
    result: GetResult,
    dst: &mut [u8],
    done: &mut usize,
    resume: &mut ResumeState,
    offset: u64,
    uri: &str,
) -> Result<Body> {
    let mut body = result.into_stream();
    loop {
        let next = tokio::time::timeout_at(resume.window_end().into(), body.next()).await;
        let chunk = match next {
            Err(_) if *done == dst.len() => return Ok(Body::Ended(None)),
            Err(_) => None,
            Ok(None) => return Ok(Body::Ended(None)),
            Ok(Some(Err(e))) => return Ok(Body::Ended(Some(storage_error(uri, e)))),
            Ok(Some(Ok(chunk))) => Some(chunk),
        };
        if let Some(chunk) = chunk {
            if chunk.len() > dst.len() - *done {
                return Err(io_error(
                    uri,
                    io::ErrorKind::InvalidData,
                    format!(
                        "server sent more than the {} bytes asked for at offset {offset}",
                        dst.len()
                    ),
                ));
            }
            dst[*done..*done + chunk.len()].copy_from_slice(&chunk);
            *done += chunk.len();
            resume.arrived(chunk.len());
            if *done == dst.len() {
                // Complete: what is left of the body is its end.
                continue;
            }
        }
        if std::time::Instant::now() >= resume.window_end() {
            if let Some(decision) = resume.window_passed() {
                return Ok(Body::Slow(decision));
            }
        }
    }
}
