//! Ranged reads into caller buffers, resuming cut-off bodies.

use std::io;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResult, ObjectStore};

use super::errors::*;
use super::retry::{Decision, RetrySettings};
use crate::error::{Error, Result};

/// Reads `dst.len()` bytes at `offset` with one ranged GET, copying each body chunk into `dst` as
/// it arrives. A body that breaks off is resumed from the first missing byte (object_store already
/// retried the request itself) for as long as [`ResumeState`] allows. A body longer than asked
/// for, an object shorter than the range, or an object that changed (ETag) between resumptions is
/// an error.
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
    let mut slow_seen: Option<(u64, Duration)> = None;
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
        let started = Instant::now();
        let cut = copy_body(result, dst, &mut done, offset, uri, retry).await?;
        if done == dst.len() {
            break;
        }
        // A body cut off (or cancelled by the stall rule) after bringing bytes below the minimum
        // rate made no progress worth resuming for: a trickle would otherwise go on for ever.
        let elapsed = started.elapsed();
        let got = (done - before) as u64;
        let slow = match &cut {
            Cut::Slow => true,
            _ => retry.min_rate > 0 && elapsed >= SLOW_AFTER && got < rate_bar(retry, elapsed),
        };
        if slow {
            slow_seen = Some((got, elapsed));
        }
        match resume.after_cut(got > 0 && !slow) {
            Decision::Resume { wait, .. } => tokio::time::sleep(wait).await,
            Decision::GiveUp { reason } => {
                if let Some((got, elapsed)) = slow_seen {
                    let rate = got as f64 / elapsed.as_secs_f64().max(1e-3);
                    return Err(io_error(
                        uri,
                        io::ErrorKind::TimedOut,
                        format!(
                            "bytes {offset}..{end} came too slowly: {rate:.0} bytes/s on the last \
                             attempt ({got} bytes in {elapsed:.1?}), under the minimum of {} \
                             bytes/s (storage_options min_rate, stall_window); {done} of {} \
                             bytes read; gave up: {reason}",
                            retry.min_rate,
                            dst.len()
                        ),
                    ));
                }
                let cut = match cut {
                    Cut::Broken(e) => Some(e),
                    _ => None,
                };
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

/// An attempt shorter than this is not judged by its rate (a reset right after the first bytes
/// says nothing about the link).
const SLOW_AFTER: Duration = Duration::from_secs(1);

/// Bytes a body must bring in `elapsed` to keep up with the minimum rate.
fn rate_bar(retry: &RetrySettings, elapsed: Duration) -> u64 {
    (retry.min_rate as f64 * elapsed.as_secs_f64()) as u64
}

/// How a body ended before its last byte.
enum Cut {
    /// It ended (or there was no cut: the range is complete).
    Ended,
    /// An error broke it off.
    Broken(Error),
    /// The stall rule cancelled it: under `min_rate` over a `stall_window`.
    Slow,
}

/// Copies the body into `dst[*done..]`, advancing `done`. Says how the body ended early, if it
/// did: an error, the stall rule (fewer than `min_rate` bytes per second over a `stall_window`:
/// the body is dropped, which closes its connection), or just an early end. A body longer than
/// `dst` is an error.
async fn copy_body(
    result: GetResult,
    dst: &mut [u8],
    done: &mut usize,
    offset: u64,
    uri: &str,
    retry: &RetrySettings,
) -> Result<Cut> {
    let mut body = result.into_stream();
    let window = retry.stall_window;
    let (mut window_start, mut window_done) = (Instant::now(), *done);
    loop {
        let next = if retry.min_rate == 0 {
            body.next().await
        } else {
            // Waits at most until the window closes, so that a body that sends nothing at all
            // is judged too.
            let left = window.saturating_sub(window_start.elapsed());
            match tokio::time::timeout(left, body.next()).await {
                Ok(next) => next,
                Err(_) => {
                    if ((*done - window_done) as u64) < rate_bar(retry, window_start.elapsed()) {
                        return Ok(Cut::Slow);
                    }
                    (window_start, window_done) = (Instant::now(), *done);
                    continue;
                }
            }
        };
        let Some(chunk) = next else { break };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return Ok(Cut::Broken(storage_error(uri, e))),
        };
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
        if retry.min_rate > 0 && window_start.elapsed() >= window {
            if ((*done - window_done) as u64) < rate_bar(retry, window_start.elapsed()) {
                return Ok(Cut::Slow);
            }
            (window_start, window_done) = (Instant::now(), *done);
        }
    }
    Ok(Cut::Ended)
}
