//! Files encrypted with Google Tink's streaming AEAD read as their plaintext: [`source`] is the
//! decorator that the opening code (`open_all` in source/open.rs) puts over each source when a
//! keyset is given, [`Decryption`] what a load asks for. The cipher itself is [`crate::tink`].

use std::sync::Arc;

use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::options::LoadOptions;
use crate::source::{open_shard, Shard, Source};
use crate::tink::{looks_encrypted, Keyset};

pub mod source;

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

#[cfg(test)]
mod tests {
    use super::*;

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
