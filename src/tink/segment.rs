//! Tink's streaming AEAD `AesGcmHkdfStreaming` wire format, both directions, one segment at a
//! time (pure: bytes in, bytes out; the crypto is ring's AES-GCM and HKDF).
//!
//! A file is a header, `[header_len (1 byte)] [salt (derived_key_size)] [nonce prefix (7)]`,
//! followed by segments of `segment_size` ciphertext bytes each (the last one shorter), the
//! first one shorter by the header. Each segment is AES-GCM with a 16-byte tag, under the key
//! `HKDF(hash, ikm = key_value, salt, info = associated_data)`, with the nonce
//! `prefix || segment index (u32, big-endian) || 1 if it is the last segment else 0`.

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use zeroize::Zeroizing;

use super::keyset::{Hash, Params, StreamingKey};

// The sizes are the leaf `layout`, which `keyset` checks a key against; named here too, as
// part of the wire format.
pub use super::layout::{header_len, NONCE_PREFIX, TAG};

/// Where the segments of a file of a given ciphertext size lie, in the ciphertext and in the
/// plaintext.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub segment_size: u64,
    pub header_len: u64,
    pub segments: u64,
    pub plain_size: u64,
}

impl Geometry {
    /// The layout of a `ciphertext_size`-byte file with `params`, as Tink computes it; `Err`
    /// with why a file of that size cannot be one (cut short inside a header or a tag).
    pub fn new(params: &Params, ciphertext_size: u64) -> Result<Geometry, String> {
        let c = params.segment_size;
        let h = header_len(params.derived_key_size) as u64;
        let tag = TAG as u64;
        if ciphertext_size < h + tag {
            return Err(format!(
                "{ciphertext_size} bytes is shorter than a header and one tag ({} bytes): \
                 the file is truncated or not Tink-encrypted",
                h + tag
            ));
        }
        let full = ciphertext_size / c;
        let rest = ciphertext_size % c;
        let segments = match rest {
            0 => full,
            r if r < tag => {
                return Err(format!(
                    "{ciphertext_size} bytes ends inside a segment's tag: the file is truncated"
                ))
            }
            _ => full + 1,
        };
        if segments > u64::from(u32::MAX) {
            return Err("more segments than the format numbers".into());
        }
        Ok(Geometry {
            segment_size: c,
            header_len: h,
            segments,
            plain_size: ciphertext_size - h - segments * tag,
        })
    }

    fn plain_segment(&self) -> u64 {
        self.segment_size - TAG as u64
    }

    /// The ciphertext bytes of segment `i` (its tag included).
    pub fn ciphertext_range(&self, i: u64, ciphertext_size: u64) -> std::ops::Range<u64> {
        let begin = if i == 0 {
            self.header_len
        } else {
            i * self.segment_size
        };
        begin..((i + 1) * self.segment_size).min(ciphertext_size)
    }

    /// The plaintext bytes segment `i` holds.
    pub fn plain_range(&self, i: u64) -> std::ops::Range<u64> {
        let p = self.plain_segment();
        let begin = if i == 0 { 0 } else { i * p - self.header_len };
        begin..((i + 1) * p - self.header_len).min(self.plain_size)
    }

    /// The ciphertext size of a `plain_size`-byte plaintext, as Tink's encrypting stream writes
    /// it: the first segment holds `segment_size - TAG - header` bytes, the others
    /// `segment_size - TAG`, the last one what remains (an empty plaintext: one empty segment).
    pub fn for_plaintext(params: &Params, plain_size: u64) -> Geometry {
        let c = params.segment_size;
        let h = header_len(params.derived_key_size) as u64;
        let p = c - TAG as u64;
        let segments = if plain_size <= p - h {
            1
        } else {
            1 + (plain_size - (p - h)).div_ceil(p)
        };
        Geometry {
            segment_size: c,
            header_len: h,
            segments,
            plain_size,
        }
    }

    /// The whole ciphertext's size.
    pub fn ciphertext_size(&self) -> u64 {
        self.header_len + self.plain_size + self.segments * TAG as u64
    }

    /// The segments holding plaintext bytes `offset..offset + len` (`len` > 0).
    pub fn segments_for(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        let p = self.plain_segment();
        let at = |pos: u64| (pos + self.header_len) / p;
        at(offset)..=at(offset + len - 1)
    }
}

/// The key of one file: derived from the keyset's key, the file's header and the associated
/// data. ring keeps the AES key schedule; the derived bytes are wiped once it is built.
pub struct SegmentKey {
    key: LessSafeKey,
    nonce_prefix: [u8; NONCE_PREFIX],
}

impl std::fmt::Debug for SegmentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SegmentKey")
    }
}

/// A segment failed authentication (AES-GCM's tag did not match): no plaintext.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unauthenticated;

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

impl SegmentKey {
    /// The key for the file whose header is `header` (at least [`header_len`] bytes: the rest
    /// is ignored); `Err` when the header is not one of this key's.
    pub fn derive(
        key: &StreamingKey,
        header: &[u8],
        associated_data: &[u8],
    ) -> Result<SegmentKey, String> {
        let size = key.params.derived_key_size;
        let h = header_len(size);
        if header.len() < h || usize::from(header[0]) != h {
            return Err(format!(
                "its header does not start with a header length of {h} bytes"
            ));
        }
        let salt = &header[1..1 + size];
        let mut nonce_prefix = [0u8; NONCE_PREFIX];
        nonce_prefix.copy_from_slice(&header[1 + size..h]);
        let algorithm = match key.params.hash {
            Hash::Sha1 => hkdf::HKDF_SHA1_FOR_LEGACY_USE_ONLY,
            Hash::Sha256 => hkdf::HKDF_SHA256,
            Hash::Sha384 => hkdf::HKDF_SHA384,
            Hash::Sha512 => hkdf::HKDF_SHA512,
        };
        let mut derived = Zeroizing::new(vec![0u8; size]);
        hkdf::Salt::new(algorithm, salt)
            .extract(&key.key_value)
            .expand(&[associated_data], Len(size))
            .and_then(|okm| okm.fill(&mut derived))
            .map_err(|_| "HKDF failed".to_string())?;
        let aes = if size == 16 {
            &aead::AES_128_GCM
        } else {
            &aead::AES_256_GCM
        };
        let key = UnboundKey::new(aes, &derived).map_err(|_| "bad AES key".to_string())?;
        Ok(SegmentKey {
            key: LessSafeKey::new(key),
            nonce_prefix,
        })
    }

    fn nonce(&self, index: u64, last: bool) -> Nonce {
        let mut n = [0u8; 12];
        n[..NONCE_PREFIX].copy_from_slice(&self.nonce_prefix);
        n[NONCE_PREFIX..11].copy_from_slice(&(index as u32).to_be_bytes());
        n[11] = u8::from(last);
        Nonce::assume_unique_for_key(n)
    }

    /// Authenticates and decrypts segment `index` in place (`segment`: its ciphertext and tag);
    /// the plaintext is the returned prefix. `Err` (and no plaintext) when it fails.
    pub fn open<'a>(
        &self,
        index: u64,
        last: bool,
        segment: &'a mut [u8],
    ) -> Result<&'a mut [u8], Unauthenticated> {
        self.key
            .open_in_place(self.nonce(index, last), Aad::empty(), segment)
            .map_err(|_| Unauthenticated)
    }

    /// Encrypts segment `index` in place (`segment`: its plaintext), appending the tag.
    pub fn seal(&self, index: u64, last: bool, segment: &mut Vec<u8>) {
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(index, last), Aad::empty(), segment)
            .expect("AES-GCM seals any segment of a u32-numbered stream");
        segment.extend_from_slice(tag.as_ref());
    }
}

impl SegmentKey {
    /// Encrypts segment `index` in place: `segment` is its plaintext followed by [`TAG`] bytes,
    /// which receive the tag.
    pub fn seal_into(&self, index: u64, last: bool, segment: &mut [u8]) {
        let (plain, tag_out) = segment.split_at_mut(segment.len() - TAG);
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(index, last), Aad::empty(), plain)
            .expect("AES-GCM seals any segment of a u32-numbered stream");
        tag_out.copy_from_slice(tag.as_ref());
    }
}

/// A fresh header for `key`: the header length, a random salt and nonce prefix.
pub fn new_header(key: &StreamingKey) -> Vec<u8> {
    use ring::rand::SecureRandom;
    let h = header_len(key.params.derived_key_size);
    let mut header = vec![0u8; h];
    header[0] = h as u8;
    ring::rand::SystemRandom::new()
        .fill(&mut header[1..])
        .expect("the system's random source works");
    header
}

/// `plaintext` encrypted whole as Tink encrypts a stream with `key` (a fresh header each call):
/// what a writer produces; [`SegmentKey::open`] and Tink read it back.
pub fn encrypt(key: &StreamingKey, associated_data: &[u8], plaintext: &[u8]) -> Vec<u8> {
    let header = new_header(key);
    let segment_key =
        SegmentKey::derive(key, &header, associated_data).expect("a header made for this key");
    let p = key.params.segment_size as usize - TAG;
    let first = p - header.len();
    let mut out = header;
    let mut rest = plaintext;
    let mut index = 0u64;
    loop {
        let n = rest.len().min(if index == 0 { first } else { p });
        let last = n == rest.len();
        let mut segment = rest[..n].to_vec();
        segment_key.seal(index, last, &mut segment);
        out.extend_from_slice(&segment);
        rest = &rest[n..];
        if last {
            return out;
        }
        index += 1;
    }
}

/// `ciphertext`, a whole stream encrypted with `key`, decrypted segment by segment, each
/// segment's plaintext handed to `each` (in one reused buffer); `Err` with the first segment that
/// fails (or why its size or header cannot be this key's).
pub fn decrypt_each(
    key: &StreamingKey,
    associated_data: &[u8],
    ciphertext: &[u8],
    mut each: impl FnMut(&[u8]),
) -> Result<(), String> {
    let size = ciphertext.len() as u64;
    let g = Geometry::new(&key.params, size)?;
    let segment_key = SegmentKey::derive(key, ciphertext, associated_data)?;
    let mut segment = Vec::with_capacity(key.params.segment_size as usize);
    for i in 0..g.segments {
        let r = g.ciphertext_range(i, size);
        segment.clear();
        segment.extend_from_slice(&ciphertext[r.start as usize..r.end as usize]);
        let plain = segment_key
            .open(i, i + 1 == g.segments, &mut segment)
            .map_err(|_| format!("segment {i} fails authentication"))?;
        each(plain);
    }
    Ok(())
}

/// `ciphertext`, a whole stream encrypted with `key`, decrypted ([`decrypt_each`]).
pub fn decrypt(
    key: &StreamingKey,
    associated_data: &[u8],
    ciphertext: &[u8],
) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(ciphertext.len());
    decrypt_each(key, associated_data, ciphertext, |p| {
        out.extend_from_slice(p)
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(segment_size: u64, derived_key_size: usize) -> StreamingKey {
        StreamingKey {
            key_id: 1,
            params: Params {
                segment_size,
                derived_key_size,
                hash: Hash::Sha256,
            },
            key_value: Zeroizing::new((0..32).collect()),
        }
    }

    /// Decrypts a whole stream segment by segment, checking the geometry on the way; `Err`:
    /// the segment that failed.
    fn decrypt_checked(key: &StreamingKey, ad: &[u8], ct: &[u8]) -> Result<Vec<u8>, u64> {
        let g = Geometry::new(&key.params, ct.len() as u64).map_err(|_| u64::MAX)?;
        let sk = SegmentKey::derive(key, ct, ad).map_err(|_| u64::MAX)?;
        let mut out = Vec::new();
        for i in 0..g.segments {
            let r = g.ciphertext_range(i, ct.len() as u64);
            let mut seg = ct[r.start as usize..r.end as usize].to_vec();
            let plain = sk.open(i, i + 1 == g.segments, &mut seg).map_err(|_| i)?;
            assert_eq!(
                plain.len() as u64,
                g.plain_range(i).end - g.plain_range(i).start
            );
            out.extend_from_slice(plain);
        }
        assert_eq!(out.len() as u64, g.plain_size);
        assert_eq!(decrypt(key, ad, ct).unwrap(), out);
        Ok(out)
    }

    #[test]
    fn round_trips_every_length_around_segment_edges() {
        for (c, dks) in [(64u64, 16usize), (80, 32), (4096, 16)] {
            let k = key(c, dks);
            let h = header_len(dks);
            let p = c as usize - TAG;
            for len in [
                0,
                1,
                p - h - 1,
                p - h,
                p - h + 1,
                2 * p - h,
                2 * p - h + 1,
                5 * p + 3,
            ] {
                let plain: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
                let ct = encrypt(&k, b"ad", &plain);
                assert_eq!(
                    decrypt_checked(&k, b"ad", &ct).unwrap(),
                    plain,
                    "c={c} len={len}"
                );
                assert!(decrypt_checked(&k, b"other", &ct).is_err());
                let g = Geometry::new(&k.params, ct.len() as u64).unwrap();
                assert_eq!(
                    Geometry::for_plaintext(&k.params, len as u64),
                    g,
                    "len={len}"
                );
                assert_eq!(g.ciphertext_size(), ct.len() as u64);
                if len > 0 {
                    for (o, n) in [(0, len), (len - 1, 1), (len / 2, len - len / 2)] {
                        let segs = g.segments_for(o as u64, n as u64);
                        assert!(g.plain_range(*segs.start()).contains(&(o as u64)));
                        assert!(g.plain_range(*segs.end()).contains(&((o + n - 1) as u64)));
                    }
                }
            }
        }
    }

    #[test]
    fn flips_truncations_and_reordering_fail_authentication() {
        let k = key(64, 16);
        let plain: Vec<u8> = (0..500u32).map(|i| i as u8).collect();
        let ct = encrypt(&k, b"", &plain);
        for i in 0..ct.len() {
            let mut bad = ct.clone();
            bad[i] ^= 0x40;
            assert!(decrypt_checked(&k, b"", &bad).is_err(), "flip at {i}");
        }
        // Cut at a segment boundary: the new last segment was not sealed as the last one.
        assert_eq!(decrypt_checked(&k, b"", &ct[..128]), Err(1));
        assert!(decrypt_checked(&k, b"", &ct[..ct.len() - 1]).is_err());
        // Segments swapped.
        let mut swapped = ct.clone();
        swapped[64..128].copy_from_slice(&ct[128..192]);
        swapped[128..192].copy_from_slice(&ct[64..128]);
        assert_eq!(decrypt_checked(&k, b"", &swapped), Err(1));
    }
}
