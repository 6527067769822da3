//! The version a load reads: every ranged request of one object is pinned to the version seen
//! first, so that an object overwritten while it loads is an error, never torn bytes.
//!
//! The pin holds every validator the store gives: the strong ETag, the version id (S3 with
//! versioning, GCS generations), `Last-Modified` and the size. Requests carry what identifies
//! the version: the version id (the request then reads that very version), `If-Match` with the
//! strong ETag, and where the store gives no ETag at all, `If-Unmodified-Since` with the pinned
//! `Last-Modified`. A server that honours them answers 412 once the object changed. Each
//! response is checked too, for servers that ignore them: any validator it carries that differs
//! from the pinned one means the object changed.
//!
//! A response must also be tied to the pinned version, not merely not contradict it: an equal
//! version id or strong ETag ties it; without either (a server that sends no ETag with its
//! bytes, though its HEAD or listing gave one) only an equal `Last-Modified` is left, and a
//! response that carries none of them, while the pin has one, fails closed
//! ([`Pin::check`]): its bytes could be any version.
//!
//! A weak ETag (`W/"..."`) is not a content identity (`If-Match` compares strongly, and two
//! different contents may share one), so it is never sent; without a strong ETag the best left is
//! to compare what each response says: the size, the (weak) ETag and `Last-Modified`. That catches
//! every overwrite that changes one of them, not one that keeps all three (`Last-Modified` has a
//! resolution of one second).

use std::io;
use std::sync::Mutex;

use crate::error::{Error, Result};

/// What a response says about the version of the object it comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Version {
    /// The ETag as sent (quotes included, `W/` for a weak one).
    pub etag: Option<String>,
    /// The store's version id (S3 `x-amz-version-id`, GCS generation, Azure version).
    pub version: Option<String>,
    /// `Last-Modified`, as the store reported it (object stores: RFC 3339 to the second).
    pub last_modified: Option<String>,
}

impl Version {
    /// The ETag, when it is strong: the one an `If-Match` may carry.
    pub fn strong_etag(&self) -> Option<&str> {
        self.etag.as_deref().filter(|e| is_strong(e))
    }

    /// With only what identifies a version: a strong ETag (a weak one is dropped: a HEAD's or
    /// listing's weak ETag pins nothing) and a version id (an S3 bucket without versioning says
    /// `null`), and Last-Modified.
    pub fn identifying(self) -> Version {
        let mut v = self.normalized();
        v.etag = v.etag.filter(|e| is_strong(e));
        v
    }

    /// Without what says nothing: an empty header, S3's version `null` (no versioning).
    pub fn normalized(mut self) -> Version {
        self.etag = self.etag.filter(|e| !e.trim().is_empty());
        self.version = self.version.filter(|v| !v.is_empty() && v != "null");
        self.last_modified = self.last_modified.filter(|t| !t.trim().is_empty());
        self
    }

    /// Whether this version and `other` carry the same strong ETag (quotes aside: a listing may
    /// give it without them).
    fn same_strong_etag(&self, other: &Version) -> bool {
        match (self.strong_etag(), other.strong_etag()) {
            (Some(a), Some(b)) => tag(a) == tag(b),
            _ => false,
        }
    }

    /// What identifies this version, for messages: `ETag "a"`, `version v1`, `Last-Modified t`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(e) = &self.etag {
            parts.push(format!("ETag {e}"));
        }
        if let Some(v) = &self.version {
            parts.push(format!("version {v}"));
        }
        if let Some(t) = &self.last_modified {
            parts.push(format!("Last-Modified {t}"));
        }
        parts.join(", ")
    }
}

/// An ETag without its quotes (and surrounding blanks): a listing may give it in another form
/// than a response's header (GCS's JSON listing without quotes).
pub fn tag(etag: &str) -> &str {
    etag.trim().trim_matches('"')
}

/// Whether `etag` is a strong entity tag (not `W/"..."`, not empty).
pub fn is_strong(etag: &str) -> bool {
    let etag = etag.trim();
    !etag.is_empty() && !etag.starts_with("W/")
}

/// The version one object is pinned to, shared by all reads of that object in one load.
#[derive(Debug)]
pub struct Pin {
    /// The object's size, once known.
    size: Mutex<Option<u64>>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    seen: Option<Version>,
    /// The pinned ETag is in the form the server sends with its bytes (a HEAD's or a response's
    /// header; a listing may give it in another form), so `If-Match` may carry it.
    confirmed: bool,
    /// A response was checked against the pin. Before that, the pin is what a HEAD or listing
    /// said, and a first response that disagrees may be the server's validators disagreeing
    /// rather than a change ([`Pin::known_unserved`]).
    served: bool,
    /// A HEAD was asked for the ETag's header form ([`Pin::confirmation_due`]).
    head_asked: bool,
}

impl Pin {
    /// A pin for an object of `size` bytes (`None`: as the first response says); `known` is the
    /// version seen when it was listed or its metadata read (the cache names its copy by it),
    /// else the first response pins it. A known ETag is sent as `If-Match` only once a response
    /// gave it in its header form ([`Pin::confirmed`] when it is already).
    pub fn new(size: Option<u64>, known: Option<Version>) -> Pin {
        let known = known
            .map(Version::identifying)
            .filter(|v| v != &Version::default());
        Pin {
            size: Mutex::new(size),
            state: Mutex::new(State {
                seen: known,
                ..State::default()
            }),
        }
    }

    /// The same pin, its known ETag taken as the server sends it with its bytes (it came from a
    /// HEAD's header): the first request carries it as `If-Match` already.
    pub fn confirmed(self) -> Pin {
        self.state.lock().expect("pin lock").confirmed = true;
        self
    }

    /// The version to request: what is pinned so far (nothing before the first response): its
    /// ETag only in the server's own form, and its Last-Modified only when it has no strong
    /// ETag (then it is what is left to send, as `If-Unmodified-Since`).
    pub fn current(&self) -> Version {
        let state = self.state.lock().expect("pin lock");
        let mut version = state.seen.clone().unwrap_or_default();
        if version.strong_etag().is_some() {
            version.last_modified = None;
        }
        if !state.confirmed {
            version.etag = None;
        }
        version
    }

    /// Every validator pinned so far (nothing before the first response or listing).
    pub fn pinned(&self) -> Version {
        let state = self.state.lock().expect("pin lock");
        state.seen.clone().unwrap_or_default()
    }

    /// The version pinned from a HEAD or listing before any response was checked against it:
    /// a first response that contradicts it may be a server whose validators disagree.
    pub fn known_unserved(&self) -> Option<Version> {
        let state = self.state.lock().expect("pin lock");
        (!state.served).then(|| state.seen.clone()).flatten()
    }

    /// Whether anything is pinned: a version was known at opening, or a response was read.
    pub fn is_pinned(&self) -> bool {
        let state = self.state.lock().expect("pin lock");
        state.served || state.seen.is_some()
    }

    /// Whether a known strong ETag still waits for its header form (its listing gave it, no
    /// response carried one): a HEAD can give it, so that `If-Match` can be sent. True once per
    /// pin: a HEAD that gives none is not asked again.
    pub fn confirmation_due(&self) -> bool {
        let mut state = self.state.lock().expect("pin lock");
        let due = !state.confirmed
            && !state.head_asked
            && state
                .seen
                .as_ref()
                .is_some_and(|v| v.strong_etag().is_some());
        state.head_asked |= due;
        due
    }

    /// Takes a HEAD's answer as the header form of the pinned ETag (see
    /// [`Pin::confirmation_due`]); a HEAD that gives another ETag or version says the object
    /// changed since it was pinned: [`changed`].
    pub fn confirm(&self, name: &str, head: &Version) -> Result<()> {
        let head = head.clone().identifying();
        let mut guard = self.state.lock().expect("pin lock");
        let State {
            seen, confirmed, ..
        } = &mut *guard;
        let Some(pinned) = seen.as_mut() else {
            return Ok(());
        };
        if let Some(why) = contradiction(pinned, &head) {
            return Err(changed(name, why));
        }
        if let Some(etag) = head.strong_etag() {
            pinned.etag = Some(etag.to_string());
            *confirmed = true;
        }
        Ok(())
    }

    /// Forgets the version (not the size): the next response pins it again. For a source whose
    /// requests moved to another server, whose ETags are its own.
    pub fn reset(&self) {
        *self.state.lock().expect("pin lock") = State::default();
    }

    /// The pinned strong ETag, if any: the cache names its copy by it.
    pub fn etag(&self) -> Option<String> {
        self.pinned().strong_etag().map(str::to_string)
    }

    /// Checks what a response says against the pin, and pins what is not pinned yet. An object
    /// that changed (another size, ETag, version id, or without an identity in common another
    /// Last-Modified) is [`changed`]; a response that carries nothing to tie it to a pinned
    /// version (no ETag, version id nor Last-Modified, where the pin has one) is [`untied`].
    pub fn check(&self, name: &str, got: &Version, size: Option<u64>) -> Result<()> {
        let got = got.clone().normalized();
        if let Some(now) = size {
            let mut pinned = self.size.lock().expect("pin lock");
            match *pinned {
                Some(was) if was != now => {
                    return Err(changed(
                        name,
                        format!("it is {now} bytes now, {was} when loading began"),
                    ))
                }
                _ => *pinned = Some(now),
            }
        }
        let mut guard = self.state.lock().expect("pin lock");
        let State {
            seen,
            confirmed,
            served,
            ..
        } = &mut *guard;
        let Some(pinned) = seen.as_mut() else {
            *confirmed = got.strong_etag().is_some();
            *seen = Some(got);
            *served = true;
            return Ok(());
        };
        if let Some(why) = contradiction(pinned, &got) {
            return Err(changed(name, why));
        }
        // Tied: the same version id or strong ETag; else (a weak ETag says "equivalent") the same
        // weak ETag or Last-Modified, which is all such a server gives.
        let same = |a: &Option<String>, b: &Option<String>| a.is_some() && a == b;
        let tied = same(&pinned.version, &got.version)
            || pinned.same_strong_etag(&got)
            || same(&pinned.etag, &got.etag)
            || same(&pinned.last_modified, &got.last_modified);
        let identified =
            pinned.etag.is_some() || pinned.version.is_some() || pinned.last_modified.is_some();
        if identified && !tied {
            return Err(untied(name, pinned, &got));
        }
        // What the pin did not know yet (a listing gives no version id), and its ETag in the
        // form the server sends it.
        if got.etag.is_some() && (pinned.etag.is_none() || tied) {
            pinned.etag = got.etag.clone();
            *confirmed = got.strong_etag().is_some();
        }
        pinned.version = pinned.version.take().or_else(|| got.version.clone());
        pinned.last_modified = pinned
            .last_modified
            .take()
            .or_else(|| got.last_modified.clone());
        *served = true;
        Ok(())
    }
}

/// Why `got` cannot be the `pinned` version, if it cannot: a validator both carry differs. An
/// equal strong ETag or version id names one content, whose Last-Modified may differ between
/// replicas; without one, Last-Modified must be equal too.
fn contradiction(pinned: &Version, got: &Version) -> Option<String> {
    let differs =
        |a: &Option<String>, b: &Option<String>| matches!((a, b), (Some(a), Some(b)) if a != b);
    let (was, now) = (pinned.etag.as_deref(), got.etag.as_deref());
    if let (Some(was), Some(now)) = (was, now) {
        if tag(was) != tag(now) {
            return Some(format!("its ETag is {now}, was {was}"));
        }
    }
    if differs(&pinned.version, &got.version) {
        let (was, now) = (pinned.version.as_deref(), got.version.as_deref());
        let (was, now) = (was.unwrap_or_default(), now.unwrap_or_default());
        return Some(format!("its version is {now}, was {was}"));
    }
    let identity =
        pinned.same_strong_etag(got) || (pinned.version.is_some() && pinned.version == got.version);
    if !identity && differs(&pinned.last_modified, &got.last_modified) {
        let (was, now) = (
            pinned.last_modified.as_deref(),
            got.last_modified.as_deref(),
        );
        let (was, now) = (was.unwrap_or_default(), now.unwrap_or_default());
        return Some(format!("it was modified at {now}, {was} before"));
    }
    None
}

/// The error of a response that cannot be tied to the pinned version: it carries none of the
/// validators the pin has (a server that sends no ETag with its bytes though its HEAD or listing
/// gave one). Its bytes could be of any version, so the load stops.
fn untied(name: &str, pinned: &Version, got: &Version) -> Error {
    let carried = match got.describe() {
        d if d.is_empty() => "no ETag, version id nor Last-Modified".to_string(),
        d => format!("only {d}"),
    };
    Error::Io {
        path: name.to_string(),
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a response carries {carried}, so its bytes cannot be tied to the version being \
                 loaded ({}): whether it was overwritten meanwhile cannot be told, so the load \
                 stops",
                pinned.describe()
            ),
        ),
    }
}

/// The error of an object that changed while it was being loaded (`why`: what shows it).
pub fn changed(name: &str, why: impl std::fmt::Display) -> Error {
    Error::Io {
        path: name.to_string(),
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the object changed while loading ({why}); its bytes would mix two versions, so \
                 the load stops: load it again"
            ),
        ),
    }
}

/// The error of a server whose validators disagree about an object that did not change: what
/// its HEAD (or listing) says and what its GETs say are not the same (`why`), so no response can
/// be tied to one version.
pub fn disagree(name: &str, why: impl std::fmt::Display) -> Error {
    Error::Io {
        path: name.to_string(),
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the server's validators disagree: {why}, though the object did not change (a \
                 HEAD asked again still gives what it gave when loading began); a proxy or CDN \
                 in front of the store that rewrites ETags, or compresses the bytes, does this. \
                 The bytes cannot be tied to one version, so the load stops: read the store \
                 directly"
            ),
        ),
    }
}
