//! Whether a destination file is already a complete copy of its source (a rerun skips it): the
//! same size and the same source identity, recorded when the file was published (object
//! metadata; a local file's extended attribute), or for a local file without the attribute, the
//! source's digest recomputed from the file.
//!
//! A source with a digest (a Hub file's sha256 or git blob id) is recorded by its digest only
//! when its bytes were hashed on their way ([`record`]); a copy made without checking them
//! (`verify=False`) is recorded as unchecked, so that a later `verify=True` run checks it again
//! (a local file is hashed, an object copied again) instead of taking a copy of corrupted bytes
//! for a verified one.

use std::io::Read;

use object_store::{Attribute, GetOptions, ObjectStore};

use super::list::{digest_id, Item};
use crate::error::{Error, Result};
use crate::sink::WriteOptions;
use crate::source::identity::Digest;
use crate::uri::{kind, Kind};

/// The metadata key (`x-amz-meta-fastload-source` on S3) a copy records its source's identity
/// under; locally the extended attribute `user.fastload_source`.
pub const ID_KEY: &str = "fastload-source";
const XATTR: &str = "user.fastload_source";

/// What marks a record whose bytes were not checked against the source's digest.
const UNCHECKED: &str = "unchecked ";

/// What a copy records for a source of identity `id`: `id` itself when the bytes are known to be
/// the source's (hashed on the way, or a source without a digest, whose id is no claim about the
/// bytes), else `id` marked as unchecked.
pub fn record(id: &str, checked: bool) -> String {
    match checked {
        true => id.to_string(),
        false => format!("{UNCHECKED}{id}"),
    }
}

/// What is at a destination.
#[derive(Debug, PartialEq, Eq)]
pub enum Existing {
    Absent,
    /// A complete copy of this source.
    Done,
    /// A copy of this source whose bytes were never checked, and now fail the check or cannot
    /// be checked in place (an object): copied again (it is this copy's own file, not the
    /// user's, so no `overwrite` is needed).
    Unchecked,
    /// Something else.
    Other,
}

/// What is at `dst` for `item`. With `recheck` (a `verify=True` copy of a source with a digest),
/// a copy recorded as unchecked is not done until its bytes pass.
pub fn existing(dst: &str, item: &Item, options: &WriteOptions, recheck: bool) -> Result<Existing> {
    if kind(dst) != Kind::Local {
        return existing_object(dst, item, options, recheck);
    }
    let path = crate::uri::local_path(dst);
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Absent),
        Err(e) => return Err(Error::io(path, e)),
    };
    if !meta.is_file() || meta.len() != item.source.size() {
        return Ok(Existing::Other);
    }
    let Some(id) = &item.id else {
        return Ok(Existing::Other);
    };
    let recorded = recorded_as(read_xattr(path).as_deref(), id, recheck);
    if recorded == Existing::Done {
        return Ok(Existing::Done);
    }
    // An unchecked copy to check, or no record of this source (a file copied by something
    // else, or on a filesystem without extended attributes): the file's own digest decides.
    match &item.digest {
        Some(digest) if hash_file(path, digest)? == digest_id(digest) => {
            mark_local(path, id);
            Ok(Existing::Done)
        }
        _ => Ok(recorded),
    }
}

/// What a destination's `recorded` identity says of it, for a source of identity `id`: `Done`
/// (checked, or unchecked and not to be checked again), `Unchecked` (to be checked again) or
/// `Other` (no record of this source).
fn recorded_as(recorded: Option<&str>, id: &str, recheck: bool) -> Existing {
    match recorded {
        Some(r) if r == id => Existing::Done,
        Some(r) if r.strip_prefix(UNCHECKED) == Some(id) => match recheck {
            true => Existing::Unchecked,
            false => Existing::Done,
        },
        _ => Existing::Other,
    }
}

fn existing_object(
    dst: &str,
    item: &Item,
    options: &WriteOptions,
    recheck: bool,
) -> Result<Existing> {
    let remote = crate::store::open(dst, &options.storage_options)?;
    crate::runtime::block_on(dst, async {
        let opts = GetOptions {
            head: true,
            ..Default::default()
        };
        match remote.store.get_opts(&remote.path, opts).await {
            Ok(found) => {
                let recorded = found.attributes.get(&Attribute::Metadata(ID_KEY.into()));
                Ok(match (&item.id, found.meta.size == item.source.size()) {
                    (Some(id), true) => recorded_as(recorded.map(|v| v.as_ref()), id, recheck),
                    _ => Existing::Other,
                })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(Existing::Absent),
            Err(e) => Err(crate::store::storage_error(&remote.uri, e)),
        }
    })
}

/// The digest of the file at `path`, as [`digest_id`] writes it.
fn hash_file(path: &str, digest: &Digest) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut ctx = match digest {
        Digest::Sha256(_) => ring::digest::Context::new(&ring::digest::SHA256),
        Digest::GitBlob(_) => {
            let mut c = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
            c.update(format!("blob {len}\0").as_bytes());
            c
        }
    };
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    let hex: String = ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(digest_id(&match digest {
        Digest::Sha256(_) => Digest::Sha256(hex),
        Digest::GitBlob(_) => Digest::GitBlob(hex),
    }))
}

/// Records `id` on the local file at `dst` (best effort: a filesystem without user extended
/// attributes falls back to hashing, or to refusing the file, on the next run).
pub fn mark_local(dst: &str, id: &str) {
    let path = crate::uri::local_path(dst);
    let (Ok(p), Ok(name)) = (std::ffi::CString::new(path), std::ffi::CString::new(XATTR)) else {
        return;
    };
    #[allow(unsafe_code)]
    // SAFETY: both names are NUL-terminated C strings that outlive the call; the value pointer
    // and length describe `id`'s bytes.
    unsafe {
        libc::setxattr(p.as_ptr(), name.as_ptr(), id.as_ptr().cast(), id.len(), 0);
    }
}

fn read_xattr(path: &str) -> Option<String> {
    let p = std::ffi::CString::new(path).ok()?;
    let name = std::ffi::CString::new(XATTR).ok()?;
    let mut buf = vec![0u8; 256];
    #[allow(unsafe_code)]
    // SAFETY: both names are NUL-terminated C strings that outlive the call; `buf` is writable
    // for its length.
    let n = unsafe {
        libc::getxattr(
            p.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    String::from_utf8(buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unchecked_record_is_done_only_when_not_checking_again() {
        let id = "sha256:ab12";
        assert_eq!(record(id, true), id);
        let unchecked = record(id, false);
        assert_ne!(unchecked, id);
        assert_eq!(recorded_as(Some(id), id, true), Existing::Done);
        assert_eq!(recorded_as(Some(id), id, false), Existing::Done);
        assert_eq!(recorded_as(Some(&unchecked), id, false), Existing::Done);
        assert_eq!(recorded_as(Some(&unchecked), id, true), Existing::Unchecked);
        // Another source's record, checked or not, or none: not a copy of this one.
        for other in [
            Some("sha256:cd34"),
            Some("unchecked sha256:cd34"),
            Some(""),
            None,
        ] {
            assert_eq!(recorded_as(other, id, true), Existing::Other, "{other:?}");
            assert_eq!(recorded_as(other, id, false), Existing::Other, "{other:?}");
        }
        // The mark is never taken for an id of its own.
        assert_eq!(recorded_as(Some(id), &unchecked, false), Existing::Other);
    }
}
