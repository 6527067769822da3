//! `method="direct"`: blocks whose pages are not in the page cache are read around it
//! (`O_DIRECT`) straight into the memory they land in — a GPU load's page-locked staging buffer
//! ([`super::staged`]), a segment's pooled buffer ([`super::host`]) — with no copy out of the page
//! cache and no page-cache pages to fill and evict. A read covers the aligned span around its
//! block ([`source::direct_span`]): the block may start and end inside a page, so the memory
//! has room for the span and the block starts `lead` bytes into it. Blocks whose pages are all
//! cached are read as `method="read"` reads them (memory beats the disk). The first block whose
//! source cannot be read around the page cache (not a local file, a filesystem that refuses
//! `O_DIRECT`) stops direct reads for the load: `stats()["direct_refused"]` says why.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::{add_since, Stats};
use crate::error::Result;
use crate::source::{self, DirectRead, Shard};

/// Whether a load still reads around the page cache, and its counters.
pub(super) struct Direct<'a> {
    pub on: &'a AtomicBool,
    pub stats: &'a Stats,
}

impl Direct<'_> {
    /// Reads the `len` bytes at `at` of `shard` around the page cache into `span`, the aligned
    /// span around them (`source::direct_span(at, len)`'s length, aligned in memory); `false`
    /// when they are to be read as `method="read"` reads them (cached, or direct reads
    /// stopped). A read that comes back short is an error: the file was cut short.
    pub(super) fn read(&self, shard: &Shard, at: u64, len: u64, span: &mut [u8]) -> Result<bool> {
        if !self.on.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let (start, lead, _) = source::direct_span(at, len);
        let started = Instant::now();
        match shard.source.read_direct(start, span)? {
            DirectRead::Read(n) if n < lead + len as usize => {
                Err(source::short_read(&shard.name, at, len, start + n as u64))
            }
            DirectRead::Read(_) => {
                add_since(&self.stats.read_ns, started);
                self.stats.direct_bytes.fetch_add(len, Ordering::Relaxed);
                Ok(true)
            }
            DirectRead::Cached => Ok(false),
            DirectRead::Refused(why) => {
                self.stop(&shard.name, &why);
                Ok(false)
            }
        }
    }

    /// Stops direct reads for this load, saying why (the first block to find out says it).
    pub(super) fn stop(&self, name: &str, why: &str) {
        if self.on.swap(false, Ordering::Relaxed) {
            let _ = self.stats.direct_refused.set(format!(
                "{name}: {why}; this block and the rest were read through the page cache"
            ));
        }
    }
}
