//! Sinks: where the bytes of one destination file go, the write direction's [`crate::source`].
//! Every sink implements [`Sink`], as every byte source implements `Source`; [`create`] picks
//! one by what the scheme table ([`crate::uri`]) says the destination is:
//!
//! - `local`: a temporary file beside the destination, synced and renamed into place (large
//!   files around the page cache, `direct`);
//! - `object`: an object of at most one part, sent with one PUT when finished;
//! - `multipart`: a larger object, uploaded in parts in parallel and completed last (the one
//!   multipart upload, which a copy's ranks also share to upload one file together);
//! - `encrypt`: a decorator sealing the bytes as Tink's streaming AEAD on their way to another
//!   sink, as `source::decrypt` opens them on the way back.
//!
//! Above the sinks, `header` (pure: tensor specs → the header bytes and the data order that
//! safetensors' own writer produces) and [`FileWriter`] (a safetensors file: the header, then each
//! tensor's bytes in header order, whole or in pieces: a GPU tensor's come block by block as they
//! are copied out).
//!
//! Bytes travel as [`Bytes`]: a caller's buffer (a tensor's memory, held by its owner) goes to the
//! disk or the network without a copy. A sink dropped before [`Sink::finish`] aborts: the temporary
//! file is removed, the multipart upload aborted. Nothing is visible at the destination until
//! [`Sink::finish`].

use bytes::Bytes;
use object_store::ObjectStoreExt;

use crate::error::{Error, Result};
use crate::uri::{Kind, Store};

mod direct;
mod encrypt;
mod file;
mod header;
mod local;
pub mod multipart;
mod object;

pub use encrypt::{EncryptingSink, Encryption};
pub use file::FileWriter;
pub use header::{layout, Layout, LayoutError, TensorSpec};
pub use local::LocalFile;
pub use multipart::{MultipartSink, SharedUpload};
pub use object::ObjectPut;

/// How a destination is written. Its defaults live with every other option's, in
/// [`crate::options`]; the values it takes are checked there too ([`WriteOptions::check`]).
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Replace an existing destination (otherwise [`Error::Exists`]).
    pub overwrite: bool,
    /// Object-store settings, as for reads (`endpoint`, `region`, `access_key_id`, ...).
    pub storage_options: Vec<(String, String)>,
    /// Bytes of upload parts in flight at once (object stores); `None`:
    /// [`crate::options::DEFAULT_WRITE_MEMORY_LIMIT`].
    pub memory_limit: Option<u64>,
    /// Bytes per upload part (object stores); `None`:
    /// [`crate::options::DEFAULT_PART_SIZE`], raised as needed to stay within the stores' 10,000
    /// parts ([`multipart::part_size`]).
    pub part_size: Option<u64>,
    /// User metadata stored with an object (`x-amz-meta-<key>` on S3, custom metadata on GCS and
    /// Azure): a copy records who its source was, so that a rerun can skip it.
    pub metadata: Vec<(String, String)>,
    /// Encrypt the file as Tink's streaming AEAD with this keyset's primary key (`None`: write
    /// the bytes as they are). What [`write_all`] writes (an index, a config) is never encrypted.
    pub encryption: Option<crate::sink::Encryption>,
}

impl WriteOptions {
    /// Checks the values every front end passes as given (`options::check`): a part size the
    /// stores would refuse is an error naming `part_size`, not a silently larger part.
    pub fn check(&self) -> Result<()> {
        if let Some(p) = self.part_size {
            crate::options::check("part_size", "part_size", p)?;
        }
        Ok(())
    }
}

/// The bytes of one destination file, of a length known in advance ([`create`] opens one).
pub trait Sink: Send + std::fmt::Debug {
    /// The destination, for messages.
    fn uri(&self) -> &str;

    /// Whether the destination is a local file.
    fn is_local(&self) -> bool;

    /// Bytes of the caller's buffers this sink may hold besides the parts it is uploading (the
    /// part being filled, for object stores; a local file holds nothing once written).
    fn holds_at_most(&self) -> u64;

    /// Appends `data`; may wait for earlier parts to finish uploading (memory limit).
    fn write(&mut self, data: Bytes) -> Result<()>;

    /// Makes every byte written complete and durable without publishing it (a synced temporary
    /// file; every part uploaded, the upload not completed), so that a set of files can be
    /// published only once each is whole. [`Sink::finish`] then publishes; a drop or
    /// [`Sink::abort`] still removes it. On failure the file is cleaned up.
    fn prepare(&mut self) -> Result<()>;

    /// Publishes the file: renamed into place, or the upload completed. On failure nothing is
    /// published and everything is cleaned up.
    fn finish(self: Box<Self>) -> Result<()>;

    /// Gives up: the temporary file is removed, the multipart upload aborted.
    fn abort(self: Box<Self>) -> Result<()>;
}

/// Opens `uri` (a path, `file://`, `s3://`, `gs://`, `az://`) for a file of `len` bytes.
/// Nothing is visible at `uri` until [`Sink::finish`]; with `overwrite` false an existing
/// destination is refused now (and again when the file is published). With
/// `options.encryption`, `len` is the plaintext's length; the file holds its ciphertext.
pub fn create(uri: &str, len: u64, options: &WriteOptions) -> Result<Box<dyn Sink>> {
    options.check()?;
    if let Some(encryption) = &options.encryption {
        let plain = WriteOptions {
            encryption: None,
            ..options.clone()
        };
        let sink = EncryptingSink::create(len, encryption, |n| create(uri, n, &plain))?;
        return Ok(Box::new(sink));
    }
    match crate::uri::kind(uri) {
        Kind::Local => {
            let path = crate::uri::local_path(uri);
            Ok(Box::new(LocalFile::create(path, len, options)?))
        }
        _ if crate::uri::store(uri) == Some(Store::Http) => Err(Error::UnsupportedUri {
            uri: crate::store::redact_uri(uri),
            message: "fastload writes to local paths, s3://, gs:// and az://, not to http(s):// \
                      URLs"
                .into(),
        }),
        _ => object::create(uri, len, options),
    }
}

/// Writes `data` to `uri` whole, as [`Sink`] does (an index file, a config).
pub fn write_all(uri: &str, data: Bytes, options: &WriteOptions) -> Result<()> {
    let options = WriteOptions {
        encryption: None,
        ..options.clone()
    };
    let mut sink = create(uri, data.len() as u64, &options)?;
    sink.write(data)?;
    sink.finish()
}

/// Deletes the file or object at `uri` (a stale shard of an earlier save); a missing one is fine.
pub fn remove(uri: &str, options: &WriteOptions) -> Result<()> {
    if crate::uri::kind(uri) == Kind::Local {
        let path = crate::uri::local_path(uri);
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                path: path.to_string(),
                source: e,
            }),
            _ => Ok(()),
        };
    }
    let remote = crate::store::open(uri, &options.storage_options)?;
    crate::runtime::block_on(&remote.uri, async {
        match remote.store.delete(&remote.path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(crate::store::storage_error(&remote.uri, e)),
        }
    })
}
