//! Objects of at most one part: the bytes are held (chunks of the caller's buffers, not copies)
//! and sent with one PUT when the object is finished: conditional (`PutMode::Create`) unless
//! overwriting, so that an object another writer created is never replaced. Larger objects go
//! through the multipart upload ([`super::multipart`]), which [`create`] picks by their length.

use bytes::Bytes;
use object_store::{PutMode, PutOptions, PutPayloadMut};

use super::multipart::{self, attributes, open_object, refuse_existing, MultipartSink};
use super::{Sink, WriteOptions};
use crate::error::{Error, Result};
use crate::store::{storage_error, Remote};

/// Opens `uri` for an object of `len` bytes: one PUT ([`ObjectPut`]) when it fits in one part,
/// else a [`MultipartSink`]. Without `overwrite`, an object already there is refused now.
pub(super) fn create(uri: &str, len: u64, options: &WriteOptions) -> Result<Box<dyn Sink>> {
    let remote = open_object(uri, options)?;
    let part_size = multipart::part_size(options, len);
    if !options.overwrite {
        crate::runtime::block_on(&remote.uri, refuse_existing(&remote))?;
    }
    if len > part_size {
        let sink = MultipartSink::start(remote, PutPayloadMut::new(), options, part_size)?;
        return Ok(Box::new(sink));
    }
    Ok(Box::new(ObjectPut {
        remote,
        payload: PutPayloadMut::new(),
        part_size,
        options: options.clone(),
        promoted: None,
    }))
}

/// An object sent with one PUT when finished.
pub struct ObjectPut {
    remote: Remote,
    payload: PutPayloadMut,
    part_size: u64,
    options: WriteOptions,
    /// Once prepared: the object as a multipart upload of one part, uploaded, not completed.
    promoted: Option<Box<MultipartSink>>,
}

impl std::fmt::Debug for ObjectPut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectPut({})", self.remote.uri)
    }
}

impl Sink for ObjectPut {
    fn uri(&self) -> &str {
        &self.remote.uri
    }

    fn is_local(&self) -> bool {
        false
    }

    fn holds_at_most(&self) -> u64 {
        self.part_size
    }

    fn write(&mut self, data: Bytes) -> Result<()> {
        match &mut self.promoted {
            Some(multi) => multi.write(data),
            None => {
                self.payload.push(data);
                Ok(())
            }
        }
    }

    /// One PUT cannot be stored without being published: the object becomes a multipart
    /// upload of its one part, uploaded here and completed by [`Sink::finish`].
    fn prepare(&mut self) -> Result<()> {
        if self.promoted.is_none() {
            let payload = std::mem::take(&mut self.payload);
            let multi =
                MultipartSink::start(self.remote.clone(), payload, &self.options, self.part_size)?;
            self.promoted = Some(Box::new(multi));
        }
        self.promoted.as_mut().map_or(Ok(()), |m| m.prepare())
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        if let Some(multi) = self.promoted.take() {
            return multi.finish();
        }
        let remote = &self.remote;
        let opts = PutOptions {
            mode: match self.options.overwrite {
                true => PutMode::Overwrite,
                false => PutMode::Create,
            },
            attributes: attributes(&self.options.metadata),
            ..Default::default()
        };
        let payload = std::mem::take(&mut self.payload).into();
        crate::runtime::block_on(&remote.uri, async {
            match remote.store.put_opts(&remote.path, payload, opts).await {
                Ok(_) => Ok(()),
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => Err(Error::Exists {
                    path: remote.uri.clone(),
                }),
                Err(e) => Err(storage_error(&remote.uri, e)),
            }
        })
    }

    /// Nothing was sent unless it was prepared (then its upload is aborted).
    fn abort(mut self: Box<Self>) -> Result<()> {
        self.promoted.take().map_or(Ok(()), |m| m.abort())
    }
}
