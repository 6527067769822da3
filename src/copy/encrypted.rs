//! A copy with `encryption` (`keyset=`): each `.safetensors` file is encrypted on its way (see
//! `crate::sink::encrypt`); every other file (an index, a config) is copied as it is, as
//! loaders read them in the clear. A source file that already looks Tink-encrypted is refused
//! rather than encrypted twice (copy it without a keyset to keep it as it is).
//!
//! An encrypted destination differs from its source in size, and its bytes in each run (a fresh
//! salt): a rerun skips it by its recorded identity, the source's with the key id appended, at
//! the ciphertext's size.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::Item;
use crate::error::{Error, Result};
use crate::sink::WriteOptions;
use crate::source::Source;
use crate::tink::looks_encrypted;

/// What `item`'s destination is checked against (size, recorded identity) and how it is
/// written: `item` and `write` as they are without encryption, or for a file that is not a
/// `.safetensors` file; else the ciphertext's size and the identity with the key id.
pub(super) fn target(item: &Item, write: &WriteOptions) -> Result<(Item, WriteOptions)> {
    let Some(encryption) = &write.encryption else {
        return Ok((item.clone(), write.clone()));
    };
    if !item.rel.ends_with(".safetensors") {
        let plain = WriteOptions {
            encryption: None,
            ..write.clone()
        };
        return Ok((item.clone(), plain));
    }
    let size = item.source.size();
    if size >= 8 {
        let mut first = [0u8; 8];
        let name = item.source.name().to_string();
        crate::runtime::block_on(&name, item.source.read_into(0, &mut first))?;
        if looks_encrypted(&first, size) {
            return Err(Error::AlreadyEncrypted { path: name });
        }
    }
    let check = Item {
        rel: item.rel.clone(),
        source: Arc::new(Sized {
            inner: item.source.clone(),
            size: encryption.geometry(size).ciphertext_size(),
        }),
        digest: None,
        id: item
            .id
            .as_ref()
            .map(|id| format!("{id} tink-key:{}", encryption.key().key_id)),
    };
    Ok((check, write.clone()))
}

/// A source as the size of its encryption, for the destination checks (never read).
#[derive(Debug)]
struct Sized {
    inner: Arc<dyn Source>,
    size: u64,
}

impl Source for Sized {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_into<'a>(&'a self, _offset: u64, _dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            Err(Error::Internal {
                message: format!("{}: the encrypted size stand-in was read", self.name()),
            })
        })
    }
}
