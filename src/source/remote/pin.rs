//! The version a load reads: every ranged request of one object is pinned to the version seen
//! first, so that an object overwritten while it loads is an error, never torn bytes.
//!
//! The pin is the object's strong ETag (sent as `If-Match`: a server that honours it answers
//! 412 once the object changed) and, where the store has them, its version id (S3 with
//! versioning, GCS generations: the request then reads that very version). Each response is
//! checked too, for servers that ignore `If-Match`: an ETag, version id or size other than the
//! pinned one means the object changed.
//!
//! A weak ETag (`W/"..."`) is not a content identity (`If-Match` compares strongly, and two
//! different contents may share one), so it is never sent; without a strong ETag the best left is
//! to compare what each response says: the size, the (weak) ETag and `Last-Modified`. That catches
//! every overwrite that changes one of them, not one that keeps all three.

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
    /// `Last-Modified`, as the store reported it.
    pub last_modified: Option<String>,
}

impl Version {
    /// The ETag, when it is strong: the one an `If-Match` may carry.
    pub fn strong_etag(&self) -> Option<&str> {
        self.etag.as_deref().filter(|e| is_strong(e))
    }

    /// With only what identifies a version: a strong ETag (a weak one is dropped) and a version
    /// id (an S3 bucket without versioning says `null`).
    pub fn identifying(mut self) -> Version {
        self.etag = self.etag.filter(|e| is_strong(e));
        self.version = self.version.filter(|v| !v.is_empty() && v != "null");
        self
    }
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
    seen: Mutex<Option<Version>>,
    /// The pinned ETag is in the form the server sends with its bytes (a listing may give it in
    /// another: GCS's JSON listing without quotes), so `If-Match` may carry it.
    confirmed: Mutex<bool>,
}

impl Pin {
    /// A pin for an object of `size` bytes (`None`: as the first response says); `known` is the
    /// version seen when it was listed or its metadata read (the cache names its copy by it),
    /// else the first response pins it.
    pub fn new(size: Option<u64>, known: Option<Version>) -> Pin {
        let known = known
            .map(Version::identifying)
            .filter(|v| v != &Version::default());
        Pin {
            size: Mutex::new(size),
            seen: Mutex::new(known),
            confirmed: Mutex::new(false),
        }
    }

    /// The version to request: what is pinned so far (nothing before the first response).
    pub fn current(&self) -> Version {
        let mut version = self.pinned();
        if !*self.confirmed.lock().expect("pin lock") {
            version.etag = None;
        }
        version
    }

    fn pinned(&self) -> Version {
        self.seen
            .lock()
            .expect("pin lock")
            .clone()
            .unwrap_or_default()
    }

    /// Forgets the version (not the size): the next response pins it again. For a source whose
    /// requests moved to another server, whose ETags are its own.
    pub fn reset(&self) {
        *self.seen.lock().expect("pin lock") = None;
        *self.confirmed.lock().expect("pin lock") = false;
    }

    /// The pinned strong ETag, if any: the cache names its copy by it.
    pub fn etag(&self) -> Option<String> {
        self.pinned().etag.filter(|e| is_strong(e))
    }

    /// Checks what a response says against the pin, and pins what is not pinned yet: an object
    /// that changed (another size, ETag, version id, or without a strong ETag another
    /// Last-Modified) is [`changed`].
    pub fn check(&self, name: &str, got: &Version, size: Option<u64>) -> Result<()> {
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
        let mut seen = self.seen.lock().expect("pin lock");
        let Some(pinned) = seen.as_mut() else {
            *seen = Some(got.clone());
            *self.confirmed.lock().expect("pin lock") = true;
            return Ok(());
        };
        let differs =
            |a: &Option<String>, b: &Option<String>| matches!((a, b), (Some(a), Some(b)) if a != b);
        let tag = |e: &Option<String>| e.as_deref().map(|e| e.trim().trim_matches('"').to_string());
        if differs(&tag(&pinned.etag), &tag(&got.etag)) {
            let (was, now) = (pinned.etag.as_deref(), got.etag.as_deref());
            let (was, now) = (was.unwrap_or_default(), now.unwrap_or_default());
            return Err(changed(name, format!("its ETag is {now}, was {was}")));
        }
        if differs(&pinned.version, &got.version) {
            let (was, now) = (pinned.version.as_deref(), got.version.as_deref());
            let (was, now) = (was.unwrap_or_default(), now.unwrap_or_default());
            return Err(changed(name, format!("its version is {now}, was {was}")));
        }
        if pinned.strong_etag().is_none() && differs(&pinned.last_modified, &got.last_modified) {
            let (was, now) = (
                pinned.last_modified.as_deref(),
                got.last_modified.as_deref(),
            );
            let (was, now) = (was.unwrap_or_default(), now.unwrap_or_default());
            return Err(changed(
                name,
                format!("it was modified at {now}, {was} before"),
            ));
        }
        // What the pin did not know yet (a listing gives no version id or Last-Modified), and
        // its ETag in the form the server sends it.
        if got.etag.is_some() {
            pinned.etag = got.etag.clone();
            *self.confirmed.lock().expect("pin lock") = true;
        }
        pinned.version = pinned.version.take().or_else(|| got.version.clone());
        pinned.last_modified = pinned
            .last_modified
            .take()
            .or_else(|| got.last_modified.clone());
        Ok(())
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
