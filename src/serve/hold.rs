//! `--hold`: each served file read whole into host memory at start, page-locked where a CUDA
//! driver is (the GPU path's staging memory: a peer's RDMA tier can later send from it as it
//! is), plain pooled memory otherwise, so that answering never waits on a disk.

use std::sync::Arc;

use bytes::Bytes;

use super::ranges::chunks;
use crate::device::{self, Engine, Staging};
use crate::error::Result;
use crate::source::Source;

/// One file's bytes in host memory.
pub struct Held {
    memory: Staging,
    len: usize,
    /// Whether the memory is page-locked by the CUDA driver.
    pub page_locked: bool,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.memory.as_slice()[..self.len]
    }
}

/// Where held memory comes from: the CUDA driver's page-locked memory when a driver is there.
pub fn engine() -> Option<Arc<dyn Engine>> {
    if !device::cuda_available() {
        return None;
    }
    device::engine("cuda:0").ok()
}

impl Held {
    /// Reads all of `source` into new memory (page-locked from `engine`, if any).
    pub async fn read(source: &dyn Source, engine: Option<&dyn Engine>) -> Result<Held> {
        let len = source.size() as usize;
        let (mut memory, page_locked) = match engine {
            Some(e) => (e.staging(len.max(1))?, true),
            None => (Staging::host(len.max(1))?, false),
        };
        let dst = memory.slice_mut(len);
        for (at, n) in chunks(0, len as u64) {
            let start = at as usize;
            source.read_into(at, &mut dst[start..start + n]).await?;
        }
        Ok(Held {
            memory,
            len,
            page_locked,
        })
    }

    /// `[offset, offset + len)` without a copy.
    pub fn bytes(self: &Arc<Held>, offset: u64, len: usize) -> Bytes {
        let at = offset as usize;
        Bytes::from_owner(Shared(self.clone())).slice(at..at + len)
    }
}

/// An owner `Bytes` can slice: the held memory stays while any answer's chunk refers to it.
struct Shared(Arc<Held>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::ranges::CHUNK;
    use crate::source::testing::Bytes as Mem;

    #[test]
    fn a_held_file_is_its_bytes() {
        let data: Vec<u8> = (0..(3 * CHUNK as usize + 17))
            .map(|i| (i * 31) as u8)
            .collect();
        let source = Mem {
            name: "mem://x".into(),
            data: data.clone(),
        };
        let held = crate::runtime::get()
            .block_on(Held::read(&source, None))
            .unwrap();
        let held = Arc::new(held);
        assert_eq!(held.as_ref().as_ref(), &data[..]);
        assert_eq!(
            &held.bytes(CHUNK + 3, 100)[..],
            &data[CHUNK as usize + 3..][..100]
        );
    }
}
