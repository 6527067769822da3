//! One resumable ranged read, for every remote source (object stores and the Hub): the loop
//! that fills a caller's buffer from a ranged request, resumes a body cut off midway from its
//! first missing byte, cuts and resumes a body that goes too slowly (the stall rule of
//! [`ResumeState`]), refuses a body longer than asked or an object shorter than the range, and
//! pins every request to one version of the object ([`Pin`]), so that an object changed while
//! loading is an error that says so, never a mix of two versions.
//!
//! A source supplies only [`RangedGet`]: "issue this ranged request, pinned to this version, and
//! give me what the response says about the object and its body" (or that it was refused with
//! 412, or is gone), and where it can, a HEAD. Messages are worded here, the same for every
//! source: the validator a 412 refused, a version deleted midway, a server whose HEAD and GETs
//! disagree about an object that did not change. Requests are retried (429,
//! 5xx, connection errors) by the supplier (object_store's retries, [`send`] for the Hub); this
//! loop handles what happens once a body has started.

use std::future::Future;
use std::io;
use std::ops::Range;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, StreamExt};

use crate::error::{Error, Result};

mod pin;

pub use crate::store::{io_error, Decision, ResumeState, RetrySettings};
pub use pin::{changed, disagree, Pin, Version};

/// What one ranged request answered.
pub struct Response {
    /// The bytes of the object the body carries (`start..end` when the server did as asked).
    pub range: Range<u64>,
    /// The object's whole size, when the response says it.
    pub size: Option<u64>,
    /// What the response says about the object's version.
    pub version: Version,
    /// The body, chunk by chunk; an error ends it (a cut).
    pub body: BoxStream<'static, Result<Bytes>>,
}

/// How a ranged request was answered.
pub enum Answer {
    /// With bytes.
    Bytes(Response),
    /// 412 Precondition Failed: `sent` is the precondition the request carried, as a person
    /// reads it (`If-Match: "abc"`, `If-Unmodified-Since: ...`), empty when it carried none.
    Refused { sent: String },
    /// 404 for the object (or the version the request named): it is gone.
    Gone,
}

/// Issues ranged requests for one object.
pub trait RangedGet: Send + Sync {
    /// Requests bytes `range` of the object, sending `pin`'s version as a precondition (the
    /// store's version id, `If-Match` with its strong ETag, else `If-Unmodified-Since` with its
    /// Last-Modified). A request that failed for good is its error.
    fn get<'a>(&'a self, range: Range<u64>, pin: &'a Version) -> BoxFuture<'a, Result<Answer>>;

    /// What the store says about the object now, asked apart from the reads (a HEAD); `None`
    /// where the source has no such request. [`read_range`] asks it to tell an object that
    /// changed from a server whose validators disagree, and for the ETag in its header form.
    fn head(&self) -> BoxFuture<'_, Result<Option<Version>>> {
        Box::pin(async { Ok(None) })
    }
}

/// Reads `dst.len()` bytes at `offset` of the object `get` requests (`name` in messages), each
/// request pinned to `pin`, resuming as `retry` allows.
pub async fn read_range(
    get: &dyn RangedGet,
    pin: &Pin,
    name: &str,
    offset: u64,
    dst: &mut [u8],
    retry: &RetrySettings,
) -> Result<()> {
    read_range_from(get, pin, name, offset, dst, retry, &mut 0).await
}

// boilerplate: the parameters of read_range again, with the count it keeps
/// [`read_range`], counting in `done` the bytes that landed in `dst` (from its start), also
/// when it fails: a read that goes on from another location of the same object (a peer's
/// failure, source/peer.rs) starts at the first byte missing.
pub async fn read_range_from(
    get: &dyn RangedGet,
    pin: &Pin,
    name: &str,
    offset: u64,
    dst: &mut [u8],
    retry: &RetrySettings,
    done: &mut usize,
) -> Result<()> {
    let len = dst.len();
    let end = offset
        .checked_add(len as u64)
        .ok_or_else(|| Error::option("range", format!("offset {offset} overflows")))?;
    let mut resume = retry.resume_state();
    *done = 0;
    while *done < len {
        let start = offset + *done as u64;
        let response = checked_response(get, pin, name, start..end, offset).await?;
        let before = *done;
        let cut = match copy_body(response.body, dst, done, &mut resume, offset, name).await? {
            Body::Ended(cut) => cut,
            Body::Slow(Decision::Resume { wait, .. }) => {
                tokio::time::sleep(wait).await;
                continue;
            }
            Body::Slow(Decision::GiveUp { reason }) => {
                return Err(io_error(
                    name,
                    io::ErrorKind::TimedOut,
                    format!(
                        "bytes {offset}..{end} stalled after {} of {len} bytes: {reason} \
                         (the storage options min_rate and min_rate_window set the rule)",
                        *done
                    ),
                ));
            }
        };
        if *done == len {
            break;
        }
        match resume.after_cut(*done > before) {
            Decision::Resume { wait, .. } => tokio::time::sleep(wait).await,
            Decision::GiveUp { reason } => {
                return Err(cut.unwrap_or_else(|| {
                    io_error(
                        name,
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "body ended after {} of {len} bytes at offset {offset}: {reason}",
                            *done
                        ),
                    )
                }))
            }
        }
    }
    Ok(())
}

/// The answer to a request for `range` (of a read that began at `offset`), checked against the
/// pin: the version it is of, and the range it carries.
async fn checked_response(
    get: &dyn RangedGet,
    pin: &Pin,
    name: &str,
    range: Range<u64>,
    offset: u64,
) -> Result<Response> {
    let (start, end) = (range.start, range.end);
    let want = pin.current();
    let known = pin.known_unserved();
    let response = match get.get(start..end, &want).await? {
        Answer::Bytes(response) => response,
        Answer::Refused { sent } => {
            let asked = (start..end, want);
            return Err(refused(get, name, &sent, known, asked).await);
        }
        Answer::Gone => return Err(gone(name, pin, &want)),
    };
    if let Err(e) = pin.check(name, &response.version, response.size) {
        drop(response.body);
        let asked = (start..end, want);
        return Err(disagreeing(get, name, known, &response.version, asked)
            .await
            .unwrap_or(e));
    }
    if response.version.etag.is_none() && pin.confirmation_due() {
        // A server that sends no ETag with its bytes, pinned to its listing's: its HEAD
        // gives the ETag as it compares it, so that the next requests carry If-Match.
        if let Some(head) = get.head().await? {
            pin.confirm(name, &head)?;
        }
    }
    if response.range != (start..end) {
        let what = match response.size {
            Some(size) if size < end => format!("object is {size} bytes"),
            _ => format!("the server sent bytes {:?}", response.range),
        };
        return Err(io_error(
            name,
            io::ErrorKind::UnexpectedEof,
            format!("{what}, cannot read bytes {offset}..{end} (did it change while loading?)"),
        ));
    }
    Ok(response)
}

/// The error of a request refused with 412 Precondition Failed, naming the precondition the
/// server refused. Refused before any response was read, with the pin from a HEAD or listing
/// (`known`), the server may be one whose validators disagree rather than an object that changed
/// ([`validators_disagree`]).
async fn refused(
    get: &dyn RangedGet,
    name: &str,
    sent: &str,
    known: Option<Version>,
    asked: (Range<u64>, Version),
) -> Error {
    if sent.is_empty() {
        return io_error(
            name,
            io::ErrorKind::InvalidData,
            "the server answered 412 Precondition Failed to a request that carried no \
             precondition (no If-Match, If-Unmodified-Since or version id): it refuses the \
             read for a reason of its own",
        );
    }
    if let Some(known) = known {
        if validators_disagree(get, &known, &Seen::Refused, asked).await {
            return disagree(
                name,
                format!(
                    "its GETs refuse {sent} with 412 Precondition Failed, while its HEAD gives {}",
                    known.describe()
                ),
            );
        }
    }
    changed(
        name,
        format!("the store refused {sent} with 412 Precondition Failed"),
    )
}

/// What a first GET answered, against the version its HEAD or listing gave.
enum Seen {
    /// Bytes under another ETag.
    Tag(String),
    /// 412 to the precondition of that version.
    Refused,
}

/// Rounds of a HEAD and a GET of one byte asked after a first GET contradicted the HEAD or
/// listing (`seen`), each after the other: a server whose validators disagree answers every
/// round the same (the HEAD with `known`, the GET as `seen`), while an object that changed (even
/// one overwritten back and forth, which can make one HEAD give the old version again) soon
/// shows its new version to both.
const DISAGREEMENT_ROUNDS: usize = 3;

/// Whether the server's validators disagree about an object that did not change (see
/// [`DISAGREEMENT_ROUNDS`]); `asked` is the first GET's range and version, asked again.
async fn validators_disagree(
    get: &dyn RangedGet,
    known: &Version,
    seen: &Seen,
    asked: (Range<u64>, Version),
) -> bool {
    let (range, want) = asked;
    let probe = range.start..range.start + 1;
    for round in 0..DISAGREEMENT_ROUNDS {
        let head = match get.head().await {
            Ok(Some(head)) => head.identifying(),
            _ => return false,
        };
        let same = match (known.strong_etag(), head.strong_etag()) {
            (Some(a), Some(b)) => pin::tag(a) == pin::tag(b),
            (None, None) => {
                known.last_modified.is_some() && known.last_modified == head.last_modified
            }
            _ => false,
        };
        if !same {
            return false;
        }
        if round + 1 == DISAGREEMENT_ROUNDS {
            return true;
        }
        let again = match get.get(probe.clone(), &want).await {
            Ok(again) => again,
            Err(_) => return false,
        };
        let consistent = match (seen, again) {
            (Seen::Refused, Answer::Refused { .. }) => true,
            (Seen::Tag(tag), Answer::Bytes(r)) => r
                .version
                .etag
                .as_deref()
                .is_some_and(|now| pin::tag(now) == pin::tag(tag)),
            _ => false,
        };
        if !consistent {
            return false;
        }
    }
    false
}

/// For a first response whose ETag contradicts the one its HEAD or listing gave (`known`): the
/// error when the server's validators disagree ([`validators_disagree`]), `None` when the
/// object changed.
async fn disagreeing(
    get: &dyn RangedGet,
    name: &str,
    known: Option<Version>,
    got: &Version,
    asked: (Range<u64>, Version),
) -> Option<Error> {
    let known = known?;
    let (was, now) = (known.strong_etag()?, got.etag.as_deref()?);
    if pin::tag(was) == pin::tag(now) {
        return None;
    }
    let seen = Seen::Tag(now.to_string());
    validators_disagree(get, &known, &seen, asked)
        .await
        .then(|| {
            disagree(
                name,
                format!("its GETs answer with ETag {now}, its HEAD with {was}"),
            )
        })
}

/// The error of a request answered 404 once a version was pinned: the object, or the pinned
/// version of it, was deleted while loading. Before anything was pinned, a plain missing object.
fn gone(name: &str, pin: &Pin, want: &Version) -> Error {
    if let Some(version) = &want.version {
        return changed(
            name,
            format!(
                "version {version}, the one being loaded, is gone: the store answers 404 for it \
                 (it was deleted)"
            ),
        );
    }
    if pin.is_pinned() {
        return changed(
            name,
            "it is gone: the store answers 404 for it (it was deleted)",
        );
    }
    Error::NotFound {
        path: name.to_string(),
    }
}

/// How a body ended.
enum Body {
    /// It ended, complete or early; with the error that broke it off, if one did.
    Ended(Option<Error>),
    /// The stall rule cut it: what to do next.
    Slow(Decision),
}

/// Copies `body` into `dst[*done..]`, advancing `done`, until it ends or a window of the stall
/// rule passes below the minimum rate; a body longer than `dst` is an error.
async fn copy_body(
    mut body: BoxStream<'static, Result<Bytes>>,
    dst: &mut [u8],
    done: &mut usize,
    resume: &mut ResumeState,
    offset: u64,
    name: &str,
) -> Result<Body> {
    loop {
        let next = tokio::time::timeout_at(resume.window_end().into(), body.next()).await;
        let chunk = match next {
            Err(_) if *done == dst.len() => return Ok(Body::Ended(None)),
            Err(_) => None,
            Ok(None) => return Ok(Body::Ended(None)),
            Ok(Some(Err(e))) => return Ok(Body::Ended(Some(e))),
            Ok(Some(Ok(chunk))) => Some(chunk),
        };
        if let Some(chunk) = chunk {
            if chunk.len() > dst.len() - *done {
                return Err(io_error(
                    name,
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
        if Instant::now() >= resume.window_end() {
            if let Some(decision) = resume.window_passed() {
                return Ok(Body::Slow(decision));
            }
        }
    }
}

/// What one attempt of a request came to, for [`send`].
pub enum Attempt<T, E> {
    /// Done: an answer to hand back as it is.
    Done(T),
    /// Worth asking again (429, 5xx, a connection error): after `wait` when the server said how
    /// long (`Retry-After`), else after the backoff; `last` is what to report when retries run
    /// out.
    Again { wait: Option<Duration>, last: E },
}

/// The one request-retry loop of requests that object_store does not make (the Hub's API,
/// `resolve/` and storage requests): `attempt` is made again while it says so, as `retry`'s
/// `max_retries`, `retry_timeout` and backoff allow; the last failure is `give_up`'s.
pub async fn send<T, E, F, Fut>(
    retry: &RetrySettings,
    mut attempt: F,
    give_up: impl FnOnce(E) -> Result<T>,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Attempt<T, E>, Error>>,
{
    let start = Instant::now();
    let mut state = retry.resume_state();
    let mut tries = 0;
    loop {
        let (wait, last) = match attempt().await? {
            Attempt::Done(answer) => return Ok(answer),
            Attempt::Again { wait, last } => (wait.unwrap_or_else(|| state.backoff()), last),
        };
        tries += 1;
        if tries > retry.max_retries || start.elapsed() + wait > retry.retry_timeout {
            return give_up(last);
        }
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests;
