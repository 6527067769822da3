//! One timed run of `fastload bench` and where it read from: the plain data that the verdict
//! (what bounds a run) and the report (the table and `--json`) both read: a leaf below both, so
//! the report imports the verdict and the verdict nothing of the report.

use serde::Serialize;

/// Where a run's bytes came from.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub(super) enum ReadFrom {
    /// Local files evicted from the page cache before the run (`--cold`).
    Storage,
    /// Local files in the page cache (warm runs, or cold runs whose eviction did not take).
    PageCache,
    /// Objects over the network (object stores, http(s), the Hub).
    Network,
    /// The local copy of remote objects (`--cache DIR`, or the Hugging Face cache).
    LocalCopy,
}

/// One timed load.
#[derive(Serialize, Clone, Debug)]
pub(super) struct RunReport {
    /// 1-based, in the order the runs happened.
    pub run: usize,
    /// The cache mode the run belongs to: "cold" (local files evicted from the page cache
    /// first) or "warm" (read once first).
    pub cache: &'static str,
    /// Where its bytes came from: storage, the page cache, the network or a local copy.
    pub read_from: ReadFrom,
    pub concurrency: usize,
    pub block_size: u64,
    /// The read strategy the loader used.
    pub method: &'static str,
    /// `--device cuda --method mmap`: why the load stopped lending the files' pages to the
    /// device and read the rest into staging buffers, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lend_refused: Option<String>,
    /// `--device cuda --method direct`: why the load stopped reading around the page cache and
    /// read the rest through it, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct_refused: Option<String>,
    pub bytes: u64,
    pub tensors: usize,
    /// The plan's segments: tensors are handed out a segment at a time.
    pub segments: usize,
    /// From opening the files (headers included) until the consumer read the last tensor.
    pub seconds: f64,
    /// Decimal: 10^9 bytes per second.
    pub gb_per_s: f64,
    /// From opening the files until the first tensor was available; null with no tensors.
    pub first_tensor_ms: Option<f64>,
    /// Sum of one byte per page of every tensor: depends on the file's bytes only.
    pub checksum: u64,
}

/// The fastest run (the first of equals).
pub(super) fn best<'a, R: std::borrow::Borrow<RunReport> + 'a>(runs: &'a [R]) -> &'a RunReport {
    runs.iter()
        .map(|r| r.borrow())
        .reduce(|best, r| if r.gb_per_s > best.gb_per_s { r } else { best })
        .expect("at least one run")
}

/// A warm run of 1000 bytes at `gb_per_s`, for the tests of the report and the verdict.
#[cfg(test)]
pub(super) fn sample_run(
    n: usize,
    gb_per_s: f64,
    from: ReadFrom,
    method: &'static str,
) -> RunReport {
    RunReport {
        run: n,
        cache: "warm",
        read_from: from,
        concurrency: 16,
        block_size: 8 << 20,
        method,
        lend_refused: None,
        direct_refused: None,
        bytes: 1000,
        tensors: 2,
        segments: 1,
        seconds: 1000.0 / gb_per_s / 1e9,
        gb_per_s,
        first_tensor_ms: Some(1.5),
        checksum: 7,
    }
}
