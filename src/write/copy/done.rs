//! Whether a destination file is already a complete copy of its source (a rerun skips it): the
//! same size and the same source identity, recorded when the file was published (object
//! metadata; a local file's extended attribute), or for a local file without the attribute, the
//! source's digest recomputed from the file.

use std::io::Read;

use object_store::{Attribute, GetOptions, ObjectStore};

use super::list::{digest_id, Item};
use crate::error::{Error, Result};
use crate::source::identity::Digest;
use crate::source::open::{kind, Kind};
use crate::write::WriteOptions;

/// The metadata key (`x-amz-meta-fastload-source` on S3) a copy records its source's identity
/// under; locally the extended attribute `user.fastload_source`.
pub const ID_KEY: &str = "fastload-source";
const XATTR: &str = "user.fastload_source";

/// What is at a destination.
#[derive(Debug, PartialEq, Eq)]
pub enum Existing {
    Absent,
    /// A complete copy of this source.
    Done,
    /// Something else.
    Other,
}

/// What is at `dst` for `item`.
pub fn existing(dst: &str, item: &Item, options: &WriteOptions) -> Result<Existing> {
    if kind(dst) != Kind::Local {
        return existing_object(dst, item, options);
    }
    let path = dst.strip_prefix("file://").unwrap_or(dst);
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Absent),
        Err(e) => return Err(Error::io(path, e)),
    };
    if !meta.is_file() || meta.len() != item.source.size() {
        return Ok(Existing::Other);
    }
    if item.id.is_some() && read_xattr(path).as_deref() == item.id.as_deref() {
        return Ok(Existing::Done);
    }
    match &item.digest {
        Some(digest) if hash_file(path, digest)? == digest_id(digest) => {
            if let Some(id) = &item.id {
                mark_local(path, id);
            }
            Ok(Existing::Done)
        }
        _ => Ok(Existing::Other),
    }
}

fn existing_object(dst: &str, item: &Item, options: &WriteOptions) -> Result<Existing> {
    let remote = crate::source::object::open(dst, &options.storage_options)?;
    crate::runtime::block_on(dst, async {
        let opts = GetOptions {
            head: true,
            ..Default::default()
        };
        match remote.store.get_opts(&remote.path, opts).await {
            Ok(found) => {
                let id = found.attributes.get(&Attribute::Metadata(ID_KEY.into()));
                let same = found.meta.size == item.source.size()
                    && item.id.is_some()
                    && id.map(|v| v.as_ref()) == item.id.as_deref();
                Ok(if same {
                    Existing::Done
                } else {
                    Existing::Other
                })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(Existing::Absent),
            Err(e) => Err(crate::source::object::storage_error(&remote.uri, e)),
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
    let path = dst.strip_prefix("file://").unwrap_or(dst);
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
