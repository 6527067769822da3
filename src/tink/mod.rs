//! Google Tink's streaming AEAD (`AesGcmHkdfStreaming`, e.g. the `AES256_GCM_HKDF_1MB`
//! template), the cipher both directions use: [`keyset`] reads cleartext JSON keysets, [`segment`]
//! is the wire format in both directions. A leaf: the decrypting [`Source`] decorator lives with
//! the sources (`source::decrypt`), the encrypting sink with the sinks (`sink::encrypt`).
//!
//! The whole file is encrypted, safetensors header included; its segments are authenticated
//! one by one, so ranged reads stay ranged.
//!
//! [`Source`]: crate::source::Source

pub mod keyset;
mod layout;
pub mod segment;

pub use keyset::{Keyset, StreamingKey};

/// Whether a file of `size` bytes that is not valid safetensors looks like a Tink streaming
/// ciphertext from its first 8 bytes: the first is the header length of a 16- or 32-byte derived
/// key, and read as a safetensors file's header length (a little-endian u64) they say more bytes
/// than the file has, as random salt bytes do (unless the salt's first seven bytes are zeros).
/// A plain file with a bad header of 24 or 40 bytes has a length that fits: it stays a format
/// error.
pub fn looks_encrypted(first: &[u8; 8], size: u64) -> bool {
    let header = usize::from(first[0]);
    (header == segment::header_len(16) || header == segment::header_len(32))
        && u64::from_le_bytes(*first) > size - 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_tink_headers_from_bad_safetensors_headers() {
        let tink = [40, 0x9c, 0x11, 0, 0, 0, 0, 0];
        assert!(looks_encrypted(&tink, 1 << 20));
        assert!(looks_encrypted(&[24, 1, 2, 3, 4, 5, 6, 7], 1 << 30));
        // A plain file whose 40-byte header is bad, and other lengths.
        assert!(!looks_encrypted(&[40, 0, 0, 0, 0, 0, 0, 0], 1000));
        assert!(!looks_encrypted(&[41, 0x9c, 0x11, 0, 0, 0, 0, 0], 1 << 20));
    }
}
