//! Checking a file's bytes against the digest its store gives (a Hub LFS file's sha256, its
//! `X-Linked-Etag`; a Hub file outside LFS, its git blob id) while they stream:
//! [`VerifyingSource`] hashes each contiguous prefix as its blocks complete (blocks land out of
//! order; a block ahead of the prefix waits as a copy until the gap before it is filled, so what
//! is held is at most the reads in flight ahead of the slowest one, never the file). The read that
//! completes the file fails when the digest is not the expected one, so a whole load fails before
//! it returns, and a filling copy is never published. Once every byte matched, later reads pass
//! through: a reader of parts of the file (`safe_open`) reads it whole once first
//! ([`crate::ranges::read_whole`]), so that what it serves is of a verified file.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use super::entry::hex;
use super::Decorator;
use crate::error::{Error, Result};
use crate::source::identity::{Digest, StoredChecksum};
use crate::source::Source;

/// A source whose bytes are hashed as they are read and checked against `want` once every byte
/// of the file has been read.
#[derive(Debug)]
pub struct VerifyingSource {
    inner: Arc<dyn Source>,
    /// The expected digest, lowercase hex.
    want: String,
    /// What it is ("sha256", "git blob id"), for messages.
    what: &'static str,
    state: Mutex<Hashing>,
}

/// The digest being computed.
enum Hasher {
    Ring(ring::digest::Context),
    Md5(md5::Md5),
}

impl Hasher {
    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Ring(ctx) => ctx.update(bytes),
            Hasher::Md5(ctx) => md5::Digest::update(ctx, bytes),
        }
    }

    fn finish(self) -> Vec<u8> {
        match self {
            Hasher::Ring(ctx) => ctx.finish().as_ref().to_vec(),
            Hasher::Md5(ctx) => md5::Digest::finalize(ctx).to_vec(),
        }
    }
}

struct Hashing {
    /// `None` once the outcome is known.
    ctx: Option<Hasher>,
    /// `[0, hashed)` went into `ctx`.
    hashed: u64,
    /// Pieces read beyond `hashed`, by offset.
    ahead: BTreeMap<u64, Vec<u8>>,
    /// The outcome, once every byte was hashed (`Err`: the mismatch, repeated to later reads).
    outcome: Option<std::result::Result<(), String>>,
}

impl std::fmt::Debug for Hashing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hashing")
            .field("hashed", &self.hashed)
            .field("ahead", &self.ahead.len())
            .field("outcome", &self.outcome)
            .finish()
    }
}

impl VerifyingSource {
    pub fn new(inner: Arc<dyn Source>, want: &Digest) -> VerifyingSource {
        let (algorithm, want, what, prefix) = match want {
            Digest::Sha256(want) => (&ring::digest::SHA256, want, "sha256", String::new()),
            Digest::GitBlob(want) => (
                &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
                want,
                "git blob id",
                format!("blob {}\0", inner.size()),
            ),
        };
        let mut ctx = ring::digest::Context::new(algorithm);
        ctx.update(prefix.as_bytes());
        VerifyingSource::with(inner, Hasher::Ring(ctx), want.to_ascii_lowercase(), what)
    }

    /// Checks the bytes against the sha256 or MD5 of the whole object that its store keeps
    /// (`verify=True` on an object store: S3's `x-amz-checksum-sha256` of an object put whole,
    /// GCS's and Azure's MD5); `None` for other checksums ([`super::crc::CrcSource`] checks
    /// CRCs).
    pub fn stored(inner: Arc<dyn Source>, want: &StoredChecksum) -> Option<VerifyingSource> {
        let (ctx, want, what) = match want {
            StoredChecksum::Sha256(want) => (
                Hasher::Ring(ring::digest::Context::new(&ring::digest::SHA256)),
                hex(want),
                "stored sha256",
            ),
            StoredChecksum::Md5(want) => (
                Hasher::Md5(<md5::Md5 as md5::Digest>::new()),
                hex(want),
                "stored MD5",
            ),
            _ => return None,
        };
        Some(VerifyingSource::with(inner, ctx, want, what))
    }

    fn with(inner: Arc<dyn Source>, ctx: Hasher, want: String, what: &'static str) -> Self {
        VerifyingSource {
            inner,
            want,
            what,
            state: Mutex::new(Hashing {
                ctx: Some(ctx),
                hashed: 0,
                ahead: BTreeMap::new(),
                outcome: None,
            }),
        }
    }

    /// Adds the bytes just read at `offset` to the hash; the read that completes the file gets
    /// the verdict.
    fn take(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let size = self.inner.size();
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if s.outcome.is_none() {
            let end = offset + bytes.len() as u64;
            let Some(ctx) = s.ctx.as_mut() else {
                return Ok(());
            };
            if offset <= s.hashed {
                if end > s.hashed {
                    let from = (s.hashed - offset) as usize;
                    ctx.update(&bytes[from..]);
                    s.hashed = end;
                }
                // Pieces that waited for this one.
                while let Some(entry) = s.ahead.first_entry() {
                    if *entry.key() > s.hashed {
                        break;
                    }
                    let (at, piece) = entry.remove_entry();
                    let piece_end = at + piece.len() as u64;
                    if piece_end > s.hashed {
                        let from = (s.hashed - at) as usize;
                        ctx.update(&piece[from..]);
                        s.hashed = piece_end;
                    }
                }
            } else if s.ahead.get(&offset).is_none_or(|p| p.len() < bytes.len()) {
                s.ahead.insert(offset, bytes.to_vec());
            }
            if s.hashed >= size {
                let got = hex(&s.ctx.take().map(Hasher::finish).unwrap_or_default());
                s.ahead.clear();
                s.outcome = Some(if got == self.want { Ok(()) } else { Err(got) });
            } else {
                return Ok(());
            }
        }
        match &s.outcome {
            Some(Err(got)) => Err(mismatch_of(self.inner.name(), self.what, &self.want, got)),
            _ => Ok(()),
        }
    }
}

/// The error for bytes whose digest (`what`: "sha256", "git blob id") is not the one their
/// store gives.
pub fn mismatch_of(name: &str, what: &str, want: &str, got: &str) -> Error {
    Error::io(
        name,
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} mismatch: expected {want}, the bytes read have {got}"),
        ),
    )
}

// boilerplate: a checking decorator: reads go to its source, each read is checked (as in crc.rs)
impl Decorator for VerifyingSource {
    fn inner(&self) -> &dyn Source {
        self.inner.as_ref()
    }

    fn after_read(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.take(offset, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{mem, read_all};
    use super::*;

    #[tokio::test]
    async fn out_of_order_overlapping_reads_hash_the_file_once_in_order() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let want = hex(&super::super::entry::sha256(&data));
        let order = [(0, 1000), (6000, 4000), (500, 2000), (2500, 3500)];
        let want = Digest::Sha256(want);
        let good = VerifyingSource::new(mem(data.clone()), &want);
        read_all(&good, &order).await.unwrap();
        assert!(good.state.lock().unwrap().ahead.is_empty());

        let mut bad = data.clone();
        bad[7000] ^= 1;
        let bad = VerifyingSource::new(mem(bad), &want);
        let err = read_all(&bad, &order).await.unwrap_err().to_string();
        let Digest::Sha256(hex) = &want else {
            unreachable!()
        };
        assert!(
            err.contains("mem://x") && err.contains(hex.as_str()),
            "{err}"
        );
        // Every later read says so too.
        assert!(read_all(&bad, &[(0, 10)]).await.is_err());

        // A file read in part is never judged.
        let part = VerifyingSource::new(mem(data), &Digest::Sha256("0".repeat(64)));
        read_all(&part, &[(0, 1000), (2000, 1000)]).await.unwrap();
    }

    #[tokio::test]
    async fn a_git_blob_id_is_checked_as_git_computes_it() {
        let data = b"{\"weight_map\": {}}\n".to_vec();
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
        ctx.update(format!("blob {}\0", data.len()).as_bytes());
        ctx.update(&data);
        let want = Digest::GitBlob(hex(ctx.finish().as_ref()));
        let good = VerifyingSource::new(mem(data.clone()), &want);
        read_all(&good, &[(0, data.len())]).await.unwrap();
        let mut bad = data.clone();
        bad[3] ^= 1;
        let bad = VerifyingSource::new(mem(bad), &want);
        let err = read_all(&bad, &[(0, data.len())]).await.unwrap_err();
        assert!(err.to_string().contains("git blob id mismatch"), "{err}");
    }
}
