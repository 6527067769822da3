//! Writing: safetensors files (and the small files beside them) to a local path or an object
//! store, never leaving a half-written result where a reader would find it.
//!
//! The flow, one way: `header` (pure: tensor specs → the header bytes and the data order that
//! safetensors' own writer produces) → a [`Sink`] (the bytes of one destination file: `local`
//! writes a temporary file beside the destination, syncs it and renames it into place; `object`
//! uploads parts in parallel through object_store's multipart API and completes the upload last)
//! → [`FileWriter`] (a safetensors file: the header, then each tensor's bytes in header order,
//! whole or in pieces: a GPU tensor's come block by block as they are copied out).
//!
//! Bytes travel as [`Bytes`]: a caller's buffer (a tensor's memory, held by its owner) goes to the
//! disk or the network without a copy. A sink dropped before [`Sink::finish`] aborts: the temporary
//! file is removed, the multipart upload aborted.

use bytes::Bytes;
use object_store::ObjectStoreExt;

use crate::error::{Error, Result};

pub mod copy;
mod direct;
mod encrypt;
mod header;
mod local;
mod object;

pub use encrypt::{EncryptingSink, Encryption};
pub use header::{layout, Layout, LayoutError, TensorSpec};
pub use local::LocalFile;
pub use object::ObjectUpload;

/// How a destination is written.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Replace an existing destination (otherwise [`Error::Exists`]).
    pub overwrite: bool,
    /// Object-store settings, as for reads (`endpoint`, `region`, `access_key_id`, ...).
    pub storage_options: Vec<(String, String)>,
    /// Bytes of upload parts in flight at once (object stores); `None`: [`DEFAULT_MEMORY_LIMIT`].
    pub memory_limit: Option<u64>,
    /// Bytes per upload part (object stores); `None`: [`DEFAULT_PART_SIZE`], raised as needed to
    /// stay within the stores' 10,000 parts.
    pub part_size: Option<u64>,
    /// User metadata stored with an object (`x-amz-meta-<key>` on S3, custom metadata on GCS and
    /// Azure): a copy records who its source was, so that a rerun can skip it.
    pub metadata: Vec<(String, String)>,
    /// Encrypt the file as Tink's streaming AEAD with this keyset's primary key (`None`: write
    /// the bytes as they are). What [`write_all`] writes (an index, a config) is never encrypted.
    pub encryption: Option<crate::write::Encryption>,
}

/// Upload parts in flight at most, whatever the memory limit.
pub const MAX_PARTS_IN_FLIGHT: usize = 64;
/// Default bytes held by parts being uploaded.
pub const DEFAULT_MEMORY_LIMIT: u64 = 256 << 20;
/// Default part size: large enough that per-request costs vanish, small enough to spread a file
/// over many parallel requests.
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;
/// The smallest part S3 accepts (but for the last one).
pub const MIN_PART_SIZE: u64 = crate::options::MIN_PART_SIZE;

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

/// The bytes of one destination file, of a length known in advance.
#[derive(Debug)]
pub enum Sink {
    Local(LocalFile),
    Object(Box<ObjectUpload>),
    /// The bytes encrypted on their way to a local file or an object.
    Encrypted(Box<EncryptingSink>),
}

impl Sink {
    /// Opens `uri` (a path, `file://`, `s3://`, `gs://`, `az://`) for a file of `len` bytes.
    /// Nothing is visible at `uri` until [`Sink::finish`]; with `overwrite` false an existing
    /// destination is refused now (and again when the file is published). With
    /// `options.encryption`, `len` is the plaintext's length; the file holds its ciphertext.
    pub fn create(uri: &str, len: u64, options: &WriteOptions) -> Result<Sink> {
        options.check()?;
        if let Some(encryption) = &options.encryption {
            let plain = WriteOptions {
                encryption: None,
                ..options.clone()
            };
            return EncryptingSink::create(len, encryption, |n| Sink::create(uri, n, &plain))
                .map(|e| Sink::Encrypted(Box::new(e)));
        }
        if crate::uri::is_remote(uri) {
            if crate::uri::store(uri) == Some(crate::uri::Store::Http) {
                return Err(Error::UnsupportedUri {
                    uri: crate::source::object::redact_uri(uri),
                    message: "fastload writes to local paths, s3://, gs:// and az://, not to \
                              http(s):// URLs"
                        .into(),
                });
            }
            return ObjectUpload::create(uri, len, options).map(|o| Sink::Object(Box::new(o)));
        }
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        LocalFile::create(path, len, options).map(Sink::Local)
    }

    /// The destination, for messages.
    pub fn uri(&self) -> &str {
        match self {
            Sink::Local(f) => f.shown(),
            Sink::Object(o) => o.uri(),
            Sink::Encrypted(e) => e.uri(),
        }
    }

    /// Whether the destination is a local file.
    pub fn is_local(&self) -> bool {
        match self {
            Sink::Local(_) => true,
            Sink::Object(_) => false,
            Sink::Encrypted(e) => e.is_local(),
        }
    }

    /// Bytes of the caller's buffers this sink may hold besides the parts it is uploading (the
    /// part being filled, for object stores; a local file holds nothing once written).
    pub fn holds_at_most(&self) -> u64 {
        match self {
            Sink::Local(_) => 0,
            Sink::Object(o) => o.part_size() as u64,
            // Plaintext is copied into the sink's own batches as it arrives.
            Sink::Encrypted(_) => 0,
        }
    }

    /// Appends `data`; may wait for earlier parts to finish uploading (memory limit).
    pub fn write(&mut self, data: Bytes) -> Result<()> {
        match self {
            Sink::Local(f) => f.write(&data),
            Sink::Object(o) => o.write(data),
            Sink::Encrypted(e) => e.write(&data),
        }
    }

    /// Makes every byte written complete and durable without publishing it (a synced temporary
    /// file; every part uploaded, the upload not completed), so that a set of files can be
    /// published only once each is whole. [`Sink::finish`] then publishes; a drop or
    /// [`Sink::abort`] still removes it. On failure the file is cleaned up.
    pub fn prepare(&mut self) -> Result<()> {
        match self {
            Sink::Local(f) => f.prepare(),
            Sink::Object(o) => o.prepare(),
            Sink::Encrypted(e) => e.prepare(),
        }
    }

    /// Publishes the file: renamed into place, or the multipart upload completed. On failure
    /// nothing is published and everything is cleaned up.
    pub fn finish(self) -> Result<()> {
        match self {
            Sink::Local(f) => f.finish(),
            Sink::Object(o) => o.finish(),
            Sink::Encrypted(e) => e.finish(),
        }
    }

    /// Gives up: the temporary file is removed, the multipart upload aborted.
    pub fn abort(self) -> Result<()> {
        match self {
            Sink::Local(f) => f.abort(),
            Sink::Object(o) => o.abort(),
            Sink::Encrypted(e) => e.abort(),
        }
    }
}

/// Writes `data` to `uri` whole, as [`Sink`] does (an index file, a config).
pub fn write_all(uri: &str, data: Bytes, options: &WriteOptions) -> Result<()> {
    let options = WriteOptions {
        encryption: None,
        ..options.clone()
    };
    let mut sink = Sink::create(uri, data.len() as u64, &options)?;
    sink.write(data)?;
    sink.finish()
}

/// A safetensors file being written: its header went first; each tensor's bytes follow, in the
/// header's order ([`FileWriter::order`]).
#[derive(Debug)]
pub struct FileWriter {
    sink: Sink,
    layout: Layout,
    next: usize,
    /// Bytes of tensor `next` written so far by [`FileWriter::write_part`].
    filled: u64,
}

impl FileWriter {
    /// Lays out `specs` and `metadata` as safetensors does and opens `uri` for the file.
    pub fn create(
        uri: &str,
        specs: &[TensorSpec],
        metadata: Option<&[(String, String)]>,
        options: &WriteOptions,
    ) -> Result<FileWriter> {
        let layout = layout(specs, metadata).map_err(|e| Error::InvalidTensors {
            uri: crate::source::object::redact_uri(uri),
            message: e.to_string(),
        })?;
        let mut sink = Sink::create(uri, layout.file_len(), options)?;
        sink.write(Bytes::from(layout.header.clone()))?;
        Ok(FileWriter {
            sink,
            layout,
            next: 0,
            filled: 0,
        })
    }

    /// Indices of the specs in the order their bytes go into the file.
    pub fn order(&self) -> &[usize] {
        &self.layout.order
    }

    /// The destination, for messages.
    pub fn uri(&self) -> &str {
        self.sink.uri()
    }

    /// The sink's [`Sink::holds_at_most`].
    pub fn holds_at_most(&self) -> u64 {
        self.sink.holds_at_most()
    }

    /// The size in bytes of the next tensor in [`FileWriter::order`] (`None` once all were
    /// written).
    pub fn next_len(&self) -> Option<u64> {
        let at = *self.layout.order.get(self.next)?;
        Some(self.layout.sizes[at])
    }

    /// The next piece of the next tensor's bytes (a GPU tensor's, block by block): the tensor is
    /// done once its size was given.
    pub fn write_part(&mut self, data: Bytes) -> Result<()> {
        let Some(want) = self.next_len() else {
            return Err(self.invalid(format!(
                "all {} tensors were written already",
                self.layout.order.len()
            )));
        };
        let len = data.len() as u64;
        if self.filled + len > want {
            return Err(self.invalid(format!(
                "tensor {} of the file's order: {} bytes given, {want} expected",
                self.next,
                self.filled + len
            )));
        }
        self.filled += len;
        if self.filled == want {
            self.next += 1;
            self.filled = 0;
        }
        if data.is_empty() {
            return Ok(());
        }
        self.sink.write(data)
    }

    /// The bytes of the next tensor in [`FileWriter::order`].
    pub fn write_tensor(&mut self, data: Bytes) -> Result<()> {
        if self.filled > 0 {
            return Err(self.invalid(format!(
                "tensor {} of the file's order is written in parts: {} bytes of it so far",
                self.next, self.filled
            )));
        }
        let Some(&at) = self.layout.order.get(self.next) else {
            return Err(self.invalid(format!(
                "all {} tensors were written already",
                self.layout.order.len()
            )));
        };
        let want = self.layout.sizes[at];
        if data.len() as u64 != want {
            return Err(self.invalid(format!(
                "tensor {} of the file's order: {} bytes given, {want} expected",
                self.next,
                data.len()
            )));
        }
        self.next += 1;
        if data.is_empty() {
            return Ok(());
        }
        self.sink.write(data)
    }

    /// Publishes the file once every tensor was written.
    pub fn finish(self) -> Result<()> {
        if let Err(e) = self.all_written() {
            let _ = self.sink.abort();
            return Err(e);
        }
        self.sink.finish()
    }

    /// Once every tensor was written: the file complete and durable, not yet published
    /// ([`Sink::prepare`]); [`FileWriter::finish`] publishes it.
    pub fn prepare(&mut self) -> Result<()> {
        self.all_written()?;
        self.sink.prepare()
    }

    fn all_written(&self) -> Result<()> {
        if self.next == self.layout.order.len() {
            return Ok(());
        }
        Err(self.invalid(format!(
            "only {} of {} tensors were written",
            self.next,
            self.layout.order.len()
        )))
    }

    /// Gives up; nothing is published.
    pub fn abort(self) -> Result<()> {
        self.sink.abort()
    }

    fn invalid(&self, message: String) -> Error {
        Error::InvalidTensors {
            uri: self.sink.uri().to_string(),
            message,
        }
    }
}

/// Deletes the file or object at `uri` (a stale shard of an earlier save); a missing one is fine.
pub fn remove(uri: &str, options: &WriteOptions) -> Result<()> {
    if !crate::uri::is_remote(uri) {
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                path: path.to_string(),
                source: e,
            }),
            _ => Ok(()),
        };
    }
    let remote = crate::source::object::open(uri, &options.storage_options)?;
    crate::runtime::block_on(&remote.uri, async {
        match remote.store.delete(&remote.path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(crate::source::object::storage_error(&remote.uri, e)),
        }
    })
}
