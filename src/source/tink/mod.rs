//! Files encrypted with Google Tink's streaming AEAD (`AesGcmHkdfStreaming`, e.g. the
//! `AES256_GCM_HKDF_1MB` template), read as their plaintext: [`keyset`] reads cleartext JSON
//! keysets, [`segment`] is the wire format in both directions, and [`source`] the decorator that
//! the opening code (`open_all` in source/open.rs) puts over each source when a keyset is given.
//!
//! The whole file is encrypted, safetensors header included; its segments are authenticated
//! one by one, so ranged reads stay ranged.

use std::sync::Arc;

use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::options::LoadOptions;
use crate::source::{open_shard, Shard, Source};

pub mod keyset;
mod layout;
pub mod segment;
pub mod source;

pub use keyset::Keyset;
pub use source::DecryptingSource;

use crate::options::ENV_KEYSET;

/// How a load decrypts: no keyset (files are read as they are), or a keyset and the associated
/// data the files were encrypted with.
#[derive(Clone, Debug, Default)]
pub struct Decryption {
    keyset: Option<Arc<Keyset>>,
    associated_data: Arc<Zeroizing<Vec<u8>>>,
}

impl Decryption {
    /// No decryption.
    pub fn none() -> Decryption {
        Decryption::default()
    }

    /// The decryption of a load with `options`: its `keyset` (else `FASTLOAD_KEYSET`, else
    /// none) and its `associated_data` (else empty).
    pub fn for_load(options: &LoadOptions) -> Result<Decryption> {
        let (spec, option) = match &options.keyset {
            Some(k) => (k.0.clone(), "keyset"),
            None => match std::env::var(ENV_KEYSET) {
                Ok(v) if !v.trim().is_empty() => (Zeroizing::new(v), ENV_KEYSET),
                _ => {
                    if options.associated_data.is_some() {
                        return Err(Error::option(
                            "associated_data",
                            "given without a keyset (keyset= or FASTLOAD_KEYSET)",
                        ));
                    }
                    return Ok(Decryption::none());
                }
            },
        };
        let keyset = Keyset::from_spec(&spec).map_err(|e| Error::option(option, e))?;
        Ok(Decryption {
            keyset: Some(Arc::new(keyset)),
            associated_data: Arc::new(Zeroizing::new(
                options
                    .associated_data
                    .as_ref()
                    .map(|a| a.0.to_vec())
                    .unwrap_or_default(),
            )),
        })
    }

    /// The decryption `FASTLOAD_KEYSET` asks for (for what takes no options: `inspect`, the
    /// benchmark).
    pub fn from_env() -> Result<Decryption> {
        Decryption::for_load(&LoadOptions::default())
    }

    pub fn enabled(&self) -> bool {
        self.keyset.is_some()
    }

    /// `source` as its plaintext when a keyset is given; as it is otherwise.
    pub async fn open(&self, source: Arc<dyn Source>) -> Result<Arc<dyn Source>> {
        match &self.keyset {
            None => Ok(source),
            Some(keyset) => Ok(Arc::new(
                DecryptingSource::open(source, keyset, &self.associated_data).await?,
            )),
        }
    }
}

/// How a writer encrypts: the keyset's primary key (an `AesGcmHkdfStreamingKey`) and the
/// associated data, as Tink's streaming AEAD encrypts (see `crate::write`). `Debug` shows the
/// key id only.
#[derive(Clone)]
pub struct Encryption {
    keyset: Arc<Keyset>,
    associated_data: Arc<Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = self.keyset.keys.first().map(|k| k.key_id);
        write!(f, "Encryption {{ key_id: {id:?} }}")
    }
}

impl Encryption {
    /// The encryption with `keyset` (the JSON or the path of a file holding it) and
    /// `associated_data` (`None`: empty); errors name `option` (where the keyset came from).
    pub fn new(keyset: &str, associated_data: Option<&[u8]>, option: &str) -> Result<Encryption> {
        let keyset = Keyset::from_spec(keyset).map_err(|e| Error::option(option, e))?;
        keyset.primary().map_err(|e| Error::option(option, e))?;
        Ok(Encryption {
            keyset: Arc::new(keyset),
            associated_data: Arc::new(Zeroizing::new(associated_data.unwrap_or_default().to_vec())),
        })
    }

    /// The key files are encrypted with (the primary).
    pub fn key(&self) -> &keyset::StreamingKey {
        &self.keyset.keys[0]
    }

    pub fn associated_data(&self) -> &[u8] {
        &self.associated_data
    }

    /// The layout of the encryption of a `plain_size`-byte file.
    pub fn geometry(&self, plain_size: u64) -> segment::Geometry {
        segment::Geometry::for_plaintext(&self.key().params, plain_size)
    }
}

impl Decryption {
    /// Opens `source` and reads its header, as plaintext when a keyset is given. Without one, a
    /// file whose header is not safetensors but looks like Tink's fails saying so (and to pass a
    /// keyset: [`Error::Encrypted`]), where it would otherwise be a puzzling "invalid safetensors
    /// file".
    pub async fn open_shard(&self, source: Arc<dyn Source>) -> Result<Shard> {
        if self.enabled() {
            return open_shard(self.open(source).await?).await;
        }
        match open_shard(source.clone()).await {
            Err(Error::Format { path, source: e }) => {
                let mut first = [0u8; 8];
                let size = source.size();
                if size >= 8
                    && source.read_into(0, &mut first).await.is_ok()
                    && looks_encrypted(&first, size)
                {
                    return Err(Error::Encrypted {
                        path,
                        detail: e.to_string(),
                    });
                }
                Err(Error::Format { path, source: e })
            }
            other => other,
        }
    }
}

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

    #[test]
    fn options_and_decryption_debug_hide_the_keyset() {
        let json = r#"{"key": [{"keyData": {"value": "c2VjcmV0LWtleS1ieXRlcw=="}}]}"#;
        let options = LoadOptions {
            keyset: Some(crate::options::Secret(Zeroizing::new(json.to_string()))),
            associated_data: Some(crate::options::Secret(Zeroizing::new(b"ad-bytes".to_vec()))),
            ..Default::default()
        };
        let shown = format!("{options:?}");
        assert!(
            !shown.contains("c2VjcmV0") && !shown.contains("ad-bytes"),
            "{shown}"
        );
        // Not a streaming key: refused, naming the option, without quoting the keyset.
        let err = Decryption::for_load(&options).unwrap_err().to_string();
        assert!(err.contains("keyset") && !err.contains("c2VjcmV0"), "{err}");
    }
}
