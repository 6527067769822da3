//! [`DecryptingSource`]: a Tink-encrypted file as the [`Source`] of its plaintext. Every layer
//! above (the header, plans, the pipeline, slices, GPU staging) reads plaintext offsets; a read
//! fetches the ciphertext of just the segments holding them, in one ranged read, authenticates
//! each segment and only then copies its bytes out.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::error::{Error, Result};
use crate::memory::HostBuffer;
use crate::source::Source;
use crate::tink::segment::{Geometry, SegmentKey};
use crate::tink::Keyset;

/// A decrypted segment kept from opening (the first, which holds the safetensors header, and the
/// last, authenticated at open so that a truncated file fails there).
#[derive(Debug)]
struct Kept {
    index: u64,
    plain: Vec<u8>,
}

#[derive(Debug)]
pub struct DecryptingSource {
    inner: Arc<dyn Source>,
    key: SegmentKey,
    geometry: Geometry,
    kept: Vec<Kept>,
}

/// The error of segment `segment` of `name` (or of the file, `None`).
pub(crate) fn error(name: &str, segment: Option<u64>, message: impl Into<String>) -> Error {
    Error::Decryption {
        path: name.to_string(),
        segment,
        message: message.into(),
    }
}

/// Reads over the network of at least this many segments' bytes are read straight into the
/// caller's buffer ([`DecryptingSource::read_run_into`]).
const DIRECT_SEGMENTS: u64 = 4;

/// Why a segment failed, in the error's words.
const FAILED: &str = "fails authentication: the file was modified or truncated, or the keyset \
                      or associated_data is not the one it was encrypted with";

impl DecryptingSource {
    /// Opens `inner`, a file encrypted with a key of `keyset`: the key is the first (primary
    /// first) whose header matches and that authenticates the first segment, as Tink picks it.
    /// The last segment is authenticated too, so that a truncated file fails here.
    pub async fn open(
        inner: Arc<dyn Source>,
        keyset: &Keyset,
        associated_data: &[u8],
    ) -> Result<DecryptingSource> {
        let name = inner.name().to_string();
        let size = inner.size();
        let longest = keyset
            .keys
            .iter()
            .map(|k| k.params.segment_size)
            .max()
            .unwrap_or(0);
        let mut first = vec![0u8; size.min(longest) as usize];
        inner.read_into(0, &mut first).await?;
        let mut why = Vec::new();
        for key in &keyset.keys {
            let geometry = match Geometry::new(&key.params, size) {
                Ok(g) => g,
                Err(e) => {
                    why.push(format!("key {}: {e}", key.key_id));
                    continue;
                }
            };
            let segment_key = match SegmentKey::derive(key, &first, associated_data) {
                Ok(k) => k,
                Err(e) => {
                    why.push(format!("key {}: {e}", key.key_id));
                    continue;
                }
            };
            let range = geometry.ciphertext_range(0, size);
            let mut segment = first[range.start as usize..range.end as usize].to_vec();
            let Ok(plain) = segment_key.open(0, geometry.segments == 1, &mut segment) else {
                why.push(format!("key {}: segment 0 {FAILED}", key.key_id));
                continue;
            };
            let n = plain.len();
            segment.truncate(n);
            let mut source = DecryptingSource {
                inner: inner.clone(),
                key: segment_key,
                geometry,
                kept: vec![Kept {
                    index: 0,
                    plain: segment,
                }],
            };
            if geometry.segments > 1 {
                let last = geometry.segments - 1;
                let (buf, n) = source.read_segments(last, last).await?;
                let plain = buf.as_slice()[..n].to_vec();
                source.kept.push(Kept { index: last, plain });
            }
            return Ok(source);
        }
        let message = if keyset.keys.len() == 1 {
            why.pop().unwrap_or_default()
        } else {
            format!("no key of the keyset decrypts it ({})", why.join("; "))
        };
        Err(error(&name, Some(0), message))
    }

    /// Reads segments `a..=b` in one ranged read and returns their plaintext (the first `n`
    /// bytes of the buffer), each segment authenticated; none is returned if any fails. The
    /// ciphertext lands in a pooled, pre-faulted buffer: a fresh one per read would fault in
    /// its pages on every block (see memory.rs).
    async fn read_segments(&self, a: u64, b: u64) -> Result<(HostBuffer, usize)> {
        let size = self.inner.size();
        let begin = self.geometry.ciphertext_range(a, size).start;
        let end = self.geometry.ciphertext_range(b, size).end;
        let scratch = HostBuffer::alloc_populated(
            (end - begin) as usize,
            &format!(" for segments {a}..={b} of {}", self.inner.name()),
        )?;
        #[allow(unsafe_code)]
        // SAFETY: `scratch` was allocated above and is referenced only through this slice
        // until it is returned.
        let buf = unsafe { scratch.slice_mut(0, scratch.len()) };
        self.inner.read_into(begin, buf).await?;
        let open = |buf: &mut [u8]| -> Result<usize> {
            let mut plain_end = 0;
            for i in a..=b {
                let r = self.geometry.ciphertext_range(i, size);
                let (s, e) = ((r.start - begin) as usize, (r.end - begin) as usize);
                let last = i + 1 == self.geometry.segments;
                let n = self
                    .key
                    .open(i, last, &mut buf[s..e])
                    .map_err(|_| {
                        error(self.inner.name(), Some(i), format!("segment {i} {FAILED}"))
                    })?
                    .len();
                buf.copy_within(s..s + n, plain_end);
                plain_end += n;
            }
            Ok(plain_end)
        };
        // Decrypting a block is a few ms of CPU: other tasks of this worker move meanwhile.
        let n = match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| open(buf))?
            }
            _ => open(buf)?,
        };
        Ok((scratch, n))
    }

    /// Segments `a..=b` decrypted into `win`, which wants their plaintext bytes
    /// `at..at + win.len()`: the ciphertext is read straight into `win` and only what does not
    /// fit (a tag per segment, the parts of the edge segments outside `win`) into a small buffer,
    /// two reads side by side, so a block costs no second block-sized buffer. Each segment is decrypted in place and its wanted bytes moved to their
    /// place, left of where its ciphertext lay (so no later segment's ciphertext is overwritten).
    /// On failure `win` holds partial bytes, and the read fails: nothing of it is handed out.
    async fn read_run_into(&self, a: u64, b: u64, at: u64, win: &mut [u8]) -> Result<()> {
        let size = self.inner.size();
        let begin = self.geometry.ciphertext_range(a, size).start;
        let end = self.geometry.ciphertext_range(b, size).end;
        let l = win.len();
        let overflow_buf = HostBuffer::alloc_populated(
            (end - begin) as usize - l,
            &format!(" for segments {a}..={b} of {}", self.inner.name()),
        )?;
        #[allow(unsafe_code)]
        // SAFETY: `overflow_buf` was allocated above and is referenced only through this slice.
        let overflow = unsafe { overflow_buf.slice_mut(0, overflow_buf.len()) };
        // Side by side: over the network, the small read costs no extra round trip.
        futures_util::future::try_join(
            self.inner.read_into(begin, win),
            self.inner.read_into(begin + l as u64, overflow),
        )
        .await?;
        let open = |win: &mut [u8], overflow: &mut [u8]| -> Result<()> {
            let failed =
                |i: u64| error(self.inner.name(), Some(i), format!("segment {i} {FAILED}"));
            for i in a..=b {
                let r = self.geometry.ciphertext_range(i, size);
                let (s, e) = ((r.start - begin) as usize, (r.end - begin) as usize);
                let last = i + 1 == self.geometry.segments;
                let p = self.geometry.plain_range(i).start;
                let from = at.max(p);
                let to = (at + l as u64).min(self.geometry.plain_range(i).end);
                let (src, n) = ((from - p) as usize, to.saturating_sub(from) as usize);
                let target = (from - at) as usize;
                if e <= l {
                    self.key
                        .open(i, last, &mut win[s..e])
                        .map_err(|_| failed(i))?;
                    win.copy_within(s + src..s + src + n, target);
                } else if s >= l {
                    let plain = self
                        .key
                        .open(i, last, &mut overflow[s - l..e - l])
                        .map_err(|_| failed(i))?;
                    win[target..target + n].copy_from_slice(&plain[src..src + n]);
                } else {
                    let mut segment = Vec::with_capacity(e - s);
                    segment.extend_from_slice(&win[s..]);
                    segment.extend_from_slice(&overflow[..e - l]);
                    let plain = self
                        .key
                        .open(i, last, &mut segment)
                        .map_err(|_| failed(i))?;
                    win[target..target + n].copy_from_slice(&plain[src..src + n]);
                }
            }
            Ok(())
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| open(win, overflow))
            }
            _ => open(win, overflow),
        }
    }

    fn kept(&self, index: u64) -> Option<&[u8]> {
        self.kept
            .iter()
            .find(|k| k.index == index)
            .map(|k| k.plain.as_slice())
    }
}

impl Source for DecryptingSource {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn size(&self) -> u64 {
        self.geometry.plain_size
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if dst.is_empty() {
                return Ok(());
            }
            let len = dst.len() as u64;
            if offset.checked_add(len).is_none_or(|end| end > self.size()) {
                return Err(Error::Internal {
                    message: format!(
                        "{}: read of {len} bytes at {offset} past the plaintext's {} bytes",
                        self.name(),
                        self.size()
                    ),
                });
            }
            let segments = self.geometry.segments_for(offset, len);
            let (first, last) = (*segments.start(), *segments.end());
            // Kept segments (the first and the last) are served from memory; the ones between,
            // a contiguous run, are read at once.
            let mut a = first;
            while a <= last && self.kept(a).is_some() {
                a += 1;
            }
            let mut b = last;
            while b >= a && self.kept(b).is_some() {
                if b == 0 {
                    break;
                }
                b -= 1;
            }
            // Reads of files, and blocks of several segments from the network, land in `dst`
            // (two reads); a small read over the network (a slice) is one request for whole
            // segments into a buffer of its own.
            let direct =
                self.inner.reads_block() || len >= DIRECT_SEGMENTS * self.geometry.segment_size;
            let run = if a <= b && !direct {
                Some(self.read_segments(a, b).await?)
            } else {
                None
            };
            if a <= b && direct {
                let from = offset.max(self.geometry.plain_range(a).start);
                let to = (offset + len).min(self.geometry.plain_range(b).end);
                let win = &mut dst[(from - offset) as usize..(to - offset) as usize];
                self.read_run_into(a, b, from, win).await?;
            }
            let copy = |dst: &mut [u8], plain_begin: u64, plain: &[u8]| {
                let from = offset.max(plain_begin);
                let to = (offset + len).min(plain_begin + plain.len() as u64);
                if from < to {
                    dst[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                        &plain[(from - plain_begin) as usize..(to - plain_begin) as usize],
                    );
                }
            };
            for i in first..=last {
                if let Some(plain) = self.kept(i) {
                    copy(dst, self.geometry.plain_range(i).start, plain);
                }
            }
            if let Some((buf, n)) = run {
                copy(
                    dst,
                    self.geometry.plain_range(a).start,
                    &buf.as_slice()[..n],
                );
            }
            Ok(())
        })
    }

    fn reads_block(&self) -> bool {
        self.inner.reads_block()
    }

    fn read_cost(&self) -> u64 {
        self.inner.read_cost()
    }

    /// The encrypted file's path: `fastload bench --cold` evicts it from the page cache. (It is
    /// never mapped: `map` stays `None`, its bytes are decrypted.)
    fn local_path(&self) -> Option<&std::path::Path> {
        self.inner.local_path()
    }

    /// The encrypted file's version: what the ranks that read it compare.
    fn version(&self) -> Option<String> {
        self.inner.version()
    }

    /// Segment `k` (k ≥ 1) holds plaintext from `k * (segment_size - TAG) - header_len`.
    fn grid(&self) -> Option<(u64, u64)> {
        let unit = self.geometry.segment_size - crate::tink::segment::TAG as u64;
        Some((unit, self.geometry.header_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::testing::Bytes;
    use crate::tink::keyset::{Hash, Params, StreamingKey};
    use crate::tink::segment::encrypt;
    use zeroize::Zeroizing;

    fn keyset(segment_size: u64, byte: u8) -> Keyset {
        Keyset {
            keys: vec![StreamingKey {
                key_id: 7,
                params: Params {
                    segment_size,
                    derived_key_size: 16,
                    hash: Hash::Sha256,
                },
                key_value: Zeroizing::new(vec![byte; 16]),
            }],
            primary_key_id: Some(7),
        }
    }

    fn source(data: Vec<u8>) -> Arc<dyn Source> {
        Arc::new(Bytes {
            name: "x.safetensors".into(),
            data,
        })
    }

    /// In-memory bytes read as a file is (`reads_block`): reads go straight into the caller's
    /// buffer (`read_run_into`).
    #[derive(Debug)]
    struct File(Bytes);

    impl Source for File {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
            self.0.read_into(offset, dst)
        }
        fn reads_block(&self) -> bool {
            true
        }
    }

    fn file(data: Vec<u8>) -> Arc<dyn Source> {
        Arc::new(File(Bytes {
            name: "x.safetensors".into(),
            data,
        }))
    }

    #[test]
    fn every_range_reads_the_plaintext() {
        let ks = keyset(100, 1);
        let plain: Vec<u8> = (0..1000u32).map(|i| (i * 13) as u8).collect();
        let ct = encrypt(&ks.keys[0], b"", &plain);
        for inner in [source(ct.clone()), file(ct.clone())] {
            let s = crate::runtime::block_on("t", DecryptingSource::open(inner, &ks, b"")).unwrap();
            assert_eq!(s.size(), 1000);
            for o in (0..1000).step_by(7) {
                for n in [1, 2, 59, 60, 61, 84, 85, 168, 169, 300, 1000] {
                    let n = n.min(1000 - o);
                    let mut dst = vec![0u8; n];
                    futures_util::FutureExt::now_or_never(s.read_into(o as u64, &mut dst))
                        .unwrap()
                        .unwrap();
                    assert_eq!(dst, plain[o..o + n], "{o}+{n}");
                }
            }
        }
    }

    /// The error of a read whose fifth segment was flipped: it names that segment.
    fn assert_segment_4(e: &Error) {
        assert!(
            matches!(
                e,
                Error::Decryption {
                    segment: Some(4),
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn wrong_keys_and_flips_name_the_segment() {
        let ks = keyset(100, 1);
        let plain = vec![5u8; 1000];
        let ct = encrypt(&ks.keys[0], b"", &plain);
        let open = |ct: Vec<u8>, ks: &Keyset, ad: &[u8]| {
            crate::runtime::block_on("t", DecryptingSource::open(source(ct), ks, ad))
        };
        let e = open(ct.clone(), &keyset(100, 2), b"").unwrap_err();
        assert!(
            matches!(
                e,
                Error::Decryption {
                    segment: Some(0),
                    ..
                }
            ),
            "{e}"
        );
        assert!(open(ct.clone(), &ks, b"ad").is_err());
        let mut bad = ct.clone();
        bad[ct.len() - 3] ^= 1;
        let e = open(bad, &ks, b"").unwrap_err();
        assert!(
            matches!(
                e,
                Error::Decryption {
                    segment: Some(12),
                    ..
                }
            ),
            "{e}"
        );
        let mut bad = ct.clone();
        bad[450] ^= 1;
        let s = open(bad, &ks, b"").unwrap();
        let mut dst = vec![0u8; 10];
        let e = futures_util::FutureExt::now_or_never(s.read_into(330, &mut dst))
            .unwrap()
            .unwrap_err();
        assert_segment_4(&e);
        assert_eq!(dst, [0u8; 10], "no byte of a failed segment is handed out");
        // Read as a file is, straight into the buffer: the read fails naming the segment.
        let mut bad = ct.clone();
        bad[450] ^= 1;
        let s = crate::runtime::block_on("t", DecryptingSource::open(file(bad), &ks, b"")).unwrap();
        let mut dst = vec![0u8; 300];
        let e = futures_util::FutureExt::now_or_never(s.read_into(200, &mut dst))
            .unwrap()
            .unwrap_err();
        assert_segment_4(&e);
    }
}
