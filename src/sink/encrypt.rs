//! Encrypted destinations: the bytes of a file sealed as Tink's streaming AEAD
//! (`AesGcmHkdfStreaming`, the keyset's primary key) on their way to a [`Sink`], which receives
//! the ciphertext (its length is known from the plaintext's, so the sink reserves or splits it
//! as for a plain file).
//!
//! The plaintext is copied into batches of whole segments (a tag's room after each); a full
//! batch is sealed on a blocking thread of the runtime while the next one fills, and batches go
//! to the sink in order. At most [`BATCHES_IN_FLIGHT`] batches of about [`BATCH_BYTES`] are held
//! besides the one filling, whatever the file's size.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use tokio::task::JoinHandle;

use zeroize::Zeroizing;

use super::Sink;
use crate::error::{Error, Result};
use crate::tink::segment::{new_header, Geometry, SegmentKey, TAG};
use crate::tink::{Keyset, StreamingKey};

/// Plaintext bytes per batch sealed by one task (whole segments, at least one).
pub const BATCH_BYTES: usize = 8 << 20;
/// Batches being sealed (or waiting for the sink) at once, at most.
pub const BATCHES_IN_FLIGHT: usize = 4;

/// How a writer encrypts: the keyset's primary key (an `AesGcmHkdfStreamingKey`, kept alone when
/// the keyset is read) and the associated data, as Tink's streaming AEAD encrypts. `Debug` shows
/// the key id only.
#[derive(Clone)]
pub struct Encryption {
    primary: Arc<StreamingKey>,
    associated_data: Arc<Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Encryption {{ key_id: {:?} }}",
            Some(self.primary.key_id)
        )
    }
}

impl Encryption {
    /// The encryption with `keyset` (the JSON or the path of a file holding it) and
    /// `associated_data` (`None`: empty); errors name `option` (where the keyset came from).
    pub fn new(keyset: &str, associated_data: Option<&[u8]>, option: &str) -> Result<Encryption> {
        let keyset = Keyset::from_spec(keyset).map_err(|e| Error::option(option, e))?;
        let primary = keyset
            .into_primary()
            .map_err(|e| Error::option(option, e))?;
        Ok(Encryption {
            primary: Arc::new(primary),
            associated_data: Arc::new(Zeroizing::new(associated_data.unwrap_or_default().to_vec())),
        })
    }

    /// The key files are encrypted with (the keyset's primary).
    pub fn key(&self) -> &StreamingKey {
        &self.primary
    }

    pub fn associated_data(&self) -> &[u8] {
        &self.associated_data
    }

    /// The layout of the encryption of a `plain_size`-byte file.
    pub fn geometry(&self, plain_size: u64) -> Geometry {
        Geometry::for_plaintext(&self.key().params, plain_size)
    }
}

/// One batch: ciphertext layout, each segment's plaintext then room for its tag.
struct Batch {
    buf: Vec<u8>,
    /// (index, start in `buf`, plaintext length) of each complete segment.
    segments: Vec<(u64, usize, usize)>,
}

/// A sink whose bytes are encrypted on their way.
pub struct EncryptingSink {
    inner: Box<dyn Sink>,
    key: Arc<SegmentKey>,
    geometry: Geometry,
    /// The segment being filled, and its plaintext bytes so far.
    index: u64,
    filled: usize,
    batch: Batch,
    batch_segments: usize,
    sealing: VecDeque<JoinHandle<Bytes>>,
    in_flight: usize,
}

impl std::fmt::Debug for EncryptingSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptingSink")
            .field("inner", &self.inner)
            .field("segment", &self.index)
            .finish_non_exhaustive()
    }
}

impl EncryptingSink {
    /// Encrypts a `plain_len`-byte file into `make(ciphertext length)`, which opens the sink;
    /// the header (a fresh salt and nonce prefix) goes first.
    pub fn create(
        plain_len: u64,
        encryption: &Encryption,
        make: impl FnOnce(u64) -> Result<Box<dyn Sink>>,
    ) -> Result<EncryptingSink> {
        let geometry = encryption.geometry(plain_len);
        let mut inner = make(geometry.ciphertext_size())?;
        let header = new_header(encryption.key());
        let key = SegmentKey::derive(encryption.key(), &header, encryption.associated_data())
            .map_err(|message| Error::Internal { message })?;
        inner.write(Bytes::from(header))?;
        let segment = geometry.segment_size as usize;
        let batch_segments = (BATCH_BYTES / (segment - TAG)).max(1);
        let in_flight = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(1, BATCHES_IN_FLIGHT);
        Ok(EncryptingSink {
            inner,
            key: Arc::new(key),
            geometry,
            index: 0,
            filled: 0,
            batch: Batch::new(batch_segments * segment),
            batch_segments,
            sealing: VecDeque::new(),
            in_flight,
        })
    }

    pub fn uri(&self) -> &str {
        self.inner.uri()
    }

    pub fn is_local(&self) -> bool {
        self.inner.is_local()
    }

    /// Plaintext bytes segment `index` holds.
    fn capacity(&self, index: u64) -> usize {
        let r = self.geometry.plain_range(index);
        (r.end - r.start) as usize
    }

    /// Appends plaintext; full batches are sealed in the background.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let mut rest = data;
        while !rest.is_empty() {
            if self.index >= self.geometry.segments {
                return Err(Error::Internal {
                    message: format!(
                        "{}: more than the {} bytes announced were written",
                        self.uri(),
                        self.geometry.plain_size
                    ),
                });
            }
            let cap = self.capacity(self.index);
            let n = rest.len().min(cap - self.filled);
            self.batch.buf.extend_from_slice(&rest[..n]);
            self.filled += n;
            rest = &rest[n..];
            if self.filled == cap {
                self.end_segment()?;
            }
        }
        Ok(())
    }

    /// The segment being filled is complete: room for its tag; a full batch (or the last
    /// segment's) goes to be sealed.
    fn end_segment(&mut self) -> Result<()> {
        let start = self.batch.buf.len() - self.filled;
        self.batch.segments.push((self.index, start, self.filled));
        self.batch.buf.resize(self.batch.buf.len() + TAG, 0);
        self.index += 1;
        self.filled = 0;
        if self.batch.segments.len() == self.batch_segments || self.index == self.geometry.segments
        {
            self.seal_batch()?;
        }
        Ok(())
    }

    fn seal_batch(&mut self) -> Result<()> {
        while self.sealing.len() >= self.in_flight {
            self.write_oldest()?;
        }
        let capacity = self.batch.buf.capacity();
        let batch = std::mem::replace(&mut self.batch, Batch::new(capacity));
        let key = self.key.clone();
        let last = self.geometry.segments - 1;
        let runtime = crate::runtime::try_get()?;
        self.sealing.push_back(runtime.spawn_blocking(move || {
            let Batch { mut buf, segments } = batch;
            for (index, start, len) in segments {
                key.seal_into(index, index == last, &mut buf[start..start + len + TAG]);
            }
            Bytes::from(buf)
        }));
        Ok(())
    }

    /// Waits for the oldest batch being sealed and hands it to the sink.
    fn write_oldest(&mut self) -> Result<()> {
        let Some(task) = self.sealing.pop_front() else {
            return Ok(());
        };
        let uri = self.uri().to_string();
        let sealed = crate::runtime::block_on(&uri, async {
            task.await.map_err(|e| Error::Internal {
                message: format!("{uri}: encrypting failed: {e}"),
            })
        })?;
        self.inner.write(sealed)
    }

    /// Seals what is left and publishes the file; fewer bytes than announced is an error (and
    /// nothing is published).
    pub fn finish(mut self) -> Result<()> {
        match self.prepare() {
            Ok(()) => self.inner.finish(),
            Err(e) => {
                let _ = self.inner.abort();
                Err(e)
            }
        }
    }

    /// Seals what is left and prepares the file ([`Sink::prepare`]): complete, not published.
    pub fn prepare(&mut self) -> Result<()> {
        let result = (|| {
            // An empty file: its one segment is empty and complete.
            if self.index < self.geometry.segments && self.capacity(self.index) == 0 {
                self.end_segment()?;
            }
            if self.index < self.geometry.segments {
                return Err(Error::Internal {
                    message: format!(
                        "{}: fewer than the {} bytes announced were written",
                        self.uri(),
                        self.geometry.plain_size
                    ),
                });
            }
            while !self.sealing.is_empty() {
                self.write_oldest()?;
            }
            Ok(())
        })();
        result.and_then(|()| self.inner.prepare())
    }

    /// Gives up: the batches being sealed are dropped, the sink aborted.
    pub fn abort(self) -> Result<()> {
        self.inner.abort()
    }
}

impl Sink for EncryptingSink {
    fn uri(&self) -> &str {
        EncryptingSink::uri(self)
    }

    fn is_local(&self) -> bool {
        EncryptingSink::is_local(self)
    }

    /// Plaintext is copied into the sink's own batches as it arrives.
    fn holds_at_most(&self) -> u64 {
        0
    }

    fn write(&mut self, data: Bytes) -> Result<()> {
        EncryptingSink::write(self, &data)
    }

    fn prepare(&mut self) -> Result<()> {
        EncryptingSink::prepare(self)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        EncryptingSink::finish(*self)
    }

    fn abort(self: Box<Self>) -> Result<()> {
        EncryptingSink::abort(*self)
    }
}

impl Batch {
    fn new(capacity: usize) -> Batch {
        Batch {
            buf: Vec::with_capacity(capacity),
            segments: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::WriteOptions;
    use crate::tink::segment::decrypt;

    /// A keyset of one `AesGcmHkdfStreamingKey` with `segment_size`, as Tink's JSON holds it.
    fn keyset_json(segment_size: u64) -> String {
        use base64::Engine;
        // AesGcmHkdfStreamingKey { version: 0, params: { segment_size, derived 16, SHA256 },
        // key_value: 16 bytes }
        let mut params = vec![0x08];
        let mut v = segment_size;
        while v >= 0x80 {
            params.push((v as u8) | 0x80);
            v >>= 7;
        }
        params.push(v as u8);
        params.extend_from_slice(&[0x10, 16, 0x18, 3]);
        let mut key = vec![0x12, params.len() as u8];
        key.extend_from_slice(&params);
        key.extend_from_slice(&[0x1a, 16]);
        key.extend(1..=16u8);
        let value = base64::engine::general_purpose::STANDARD.encode(key);
        format!(
            r#"{{"primaryKeyId": 9, "key": [{{"keyData": {{"typeUrl":
            "type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey", "value": "{value}",
            "keyMaterialType": "SYMMETRIC"}}, "status": "ENABLED", "keyId": 9,
            "outputPrefixType": "RAW"}}]}}"#
        )
    }

    /// The base64 key material in `keyset_json`'s keyset (a secret no message may show).
    fn key_value(json: &str) -> &str {
        json.split(r#""value": ""#)
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
    }

    #[test]
    fn writes_what_decrypts_for_every_length_and_chunking() {
        let dir = tempfile::tempdir().unwrap();
        let json = keyset_json(64);
        let enc = Encryption::new(&json, Some(b"ad"), "keyset").unwrap();
        let value = key_value(&json);
        assert_eq!(format!("{enc:?}"), "Encryption { key_id: Some(9) }");
        assert!(!value.is_empty());
        let p = 64 - TAG;
        let h = 24;
        for len in [0, 1, p - h, p - h + 1, 3 * p, 3 * p + 5, 1000] {
            let plain: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
            for chunk in [1, 7, 1000] {
                let path = dir.path().join(format!("f{len}-{chunk}"));
                let uri = path.to_str().unwrap().to_string();
                let mut sink = EncryptingSink::create(len as u64, &enc, |n| {
                    crate::sink::create(&uri, n, &WriteOptions::default())
                })
                .unwrap();
                for c in plain.chunks(chunk) {
                    sink.write(c).unwrap();
                }
                sink.finish().unwrap();
                let ct = std::fs::read(&path).unwrap();
                assert_eq!(ct.len() as u64, enc.geometry(len as u64).ciphertext_size());
                assert_eq!(
                    decrypt(enc.key(), b"ad", &ct).unwrap(),
                    plain,
                    "{len}/{chunk}"
                );
            }
        }
    }

    #[test]
    fn only_a_streaming_primary_key_encrypts() {
        let json = keyset_json(64);
        // The primary is another key (say an AEAD key, ignored for reading): no key to write with.
        let other = json.replace(r#""primaryKeyId": 9"#, r#""primaryKeyId": 10"#);
        let err = Encryption::new(&other, None, "keyset")
            .unwrap_err()
            .to_string();
        let value = key_value(&json);
        assert!(
            err.contains("primary key 10") && !err.contains(value),
            "{err}"
        );
        let none = json.replace(r#""primaryKeyId": 9, "#, "");
        let err = Encryption::new(&none, None, "keyset")
            .unwrap_err()
            .to_string();
        assert!(err.contains("primaryKeyId"), "{err}");
    }

    #[test]
    fn too_few_or_too_many_bytes_publish_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let enc = Encryption::new(&keyset_json(64), None, "keyset").unwrap();
        let path = dir.path().join("x");
        let uri = path.to_str().unwrap().to_string();
        let open = || {
            EncryptingSink::create(100, &enc, |n| {
                crate::sink::create(&uri, n, &WriteOptions::default())
            })
            .unwrap()
        };
        let mut short = open();
        short.write(&[1; 99]).unwrap();
        assert!(short.finish().is_err());
        let mut long = open();
        assert!(long.write(&[1; 101]).is_err());
        long.abort().unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
