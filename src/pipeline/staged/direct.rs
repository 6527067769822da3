//! `method="direct"` in a staged load: a block whose pages are not in the page cache is read
//! around it (`O_DIRECT`) straight into its page-locked staging buffer, so the storage device
//! writes the bytes where the copy engine reads them, with no copy out of the page cache and no
//! page-cache pages to fill and evict. The read covers the aligned span around the block (its
//! slot has room for it: [`super::span_spare`]); the block starts `lead` bytes into it. Cached
//! blocks are read as `method="read"` reads them (a copy from memory beats the disk). The first
//! block whose source cannot read around the page cache (not a local file, a filesystem that
//! refuses `O_DIRECT`) stops direct reads for the load: `stats()["direct_refused"]` says why.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Shared;
use crate::device::Staging;
use crate::error::{Error, Result};
use crate::pipeline::add_since;
use crate::source::{direct_span, DirectRead, Shard};

/// Reads the `len` bytes at `at` of `shard` around the page cache into `staging`; `false` when
/// they are to be read as `method="read"` reads them (cached, or direct reads stopped).
pub(super) fn block(
    shared: &Shared,
    shard: &Shard,
    at: u64,
    len: u64,
    staging: &mut Staging,
) -> Result<bool> {
    let (start, lead, span) = direct_span(at, len);
    let aligned = staging.as_ptr() as usize % crate::source::direct_align() == 0;
    if !aligned || span > staging.len() {
        let why = format!(
            "its staging buffer ({} bytes at {:p}) cannot take the aligned span of {span} bytes",
            staging.len(),
            staging.as_ptr()
        );
        refuse(shared, shard, &why);
        return Ok(false);
    }
    let started = Instant::now();
    let read = shard
        .source
        .read_direct(start, &mut staging.slice_mut(span)[..])?;
    let stats = &shared.feed.stats;
    match read {
        DirectRead::Read(n) if n < lead + len as usize => Err(Error::Io {
            path: shard.name.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "file ended at byte {} while reading {len} bytes at offset {at} (was it \
                     truncated while loading?)",
                    start + n as u64
                ),
            ),
        }),
        DirectRead::Read(_) => {
            add_since(&stats.read_ns, started);
            stats.direct_bytes.fetch_add(len, Ordering::Relaxed);
            staging.start_at(lead);
            Ok(true)
        }
        DirectRead::Cached => Ok(false),
        DirectRead::Refused(why) => {
            refuse(shared, shard, &why);
            Ok(false)
        }
    }
}

/// Stops direct reads for this load, saying why (the first block to find out says it).
fn refuse(shared: &Shared, shard: &Shard, why: &str) {
    if shared.direct.swap(false, Ordering::Relaxed) {
        let _ = shared.feed.stats.direct_refused.set(format!(
            "{}: {why}; this block and the rest were read through the page cache",
            shard.name
        ));
    }
}
