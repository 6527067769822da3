//! [`FileWriter`]: a safetensors file over a [`Sink`]: the header first, then each tensor's
//! bytes in the header's order, each whole or in pieces.

use bytes::Bytes;

use super::{create, layout, Layout, Sink, TensorSpec, WriteOptions};
use crate::error::{Error, Result};

/// A safetensors file being written: its header went first; each tensor's bytes follow, in the
/// header's order ([`FileWriter::order`]).
#[derive(Debug)]
pub struct FileWriter {
    sink: Box<dyn Sink>,
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
            uri: crate::store::redact_uri(uri),
            message: e.to_string(),
        })?;
        let mut sink = create(uri, layout.file_len(), options)?;
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
