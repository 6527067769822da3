//! `method="mmap"` in a staged load: a block is the file's mapped pages, lent to the engine
//! ([`Engine::lend`](crate::device::Engine::lend): a GPU page-locks them where they are, so the
//! copy engine reads the page cache with no CPU copy) instead of being read into a page-locked
//! staging buffer. The first block that cannot be lent (a source that is not a plain local file, a
//! driver that cannot page-lock read-only memory, a mapping that fails) stops lending for the
//! load: `stats()["lend_refused"]` says why, and that block and the rest are read into staging
//! buffers as `method="read"` does.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Shared;
use crate::device::Staging;
use crate::error::{Error, Result};
use crate::pipeline::add_since;
use crate::source::Shard;

/// The pages of `len` bytes at `at` in `shard`, lent to the engine; `None` when they cannot be
/// (lending then stops for this load). An error only for what reading would fail on too: the
/// file changed since its header was read.
pub(super) async fn block(
    shared: &Shared,
    shard: &Shard,
    at: u64,
    len: u64,
) -> Result<Option<Staging>> {
    let started = Instant::now();
    let (source, engine) = (shard.source.clone(), shared.engine().clone());
    // Outer: what reading would fail on too; inner: what stops lending.
    let lent = super::super::beside_reads(shard.source.as_ref(), move || {
        let mapped = match source.map(at, len as usize) {
            Some(Ok(mapped)) => mapped,
            Some(Err(e)) => return Ok(Err(e)),
            None => {
                return Ok(Err(Error::device(format!(
                    "{} cannot be mapped (only a plain local file's pages can be lent)",
                    source.name()
                ))))
            }
        };
        if mapped.is_fresh() {
            // Pages not all cached: read them in as a mapped load does (large reads from
            // several threads), rather than one fault at a time inside the registration.
            mapped.populate(0, len as usize, source.name())?;
        }
        Ok(engine.lend(mapped))
    })
    .await?;
    let stats = &shared.feed.stats;
    add_since(&stats.lend_ns, started);
    match lent {
        Ok(staging) => {
            // What was lent is what the file held when its header was read: a file cut short
            // meanwhile has no pages past its new end (and the registration would have failed).
            shard.source.check_unchanged()?;
            stats.lent_bytes.fetch_add(len, Ordering::Relaxed);
            Ok(Some(staging))
        }
        Err(e) => {
            if !shared.lending.swap(false, Ordering::Relaxed) {
                return Ok(None); // another block stopped lending first
            }
            let _ = stats.lend_refused.set(format!(
                "{}: {e}; this block and the rest were read into staging buffers",
                shard.name
            ));
            Ok(None)
        }
    }
}
