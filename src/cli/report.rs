//! What `fastload bench` prints: the human table (rows printed as runs end) and the one JSON
//! object of `--json`.

use std::collections::BTreeMap;

use serde::Serialize;

use super::compare::Compare;
use super::limits::Limit;
use super::{decimal_bytes, Device};
use crate::options::{Resolved, Size};

/// One timed load.
#[derive(Serialize, Clone, Debug)]
pub(super) struct RunReport {
    /// 1-based, in the order the runs happened.
    pub run: usize,
    /// "cold" (files evicted from the page cache before the run) or "warm".
    pub cache: &'static str,
    pub concurrency: usize,
    pub block_size: u64,
    /// The read strategy the loader used.
    pub method: &'static str,
    pub bytes: u64,
    pub tensors: usize,
    /// From opening the files (headers included) until the consumer read the last tensor.
    pub seconds: f64,
    /// Decimal: 10^9 bytes per second.
    pub gb_per_s: f64,
    /// From opening the files until the first tensor was available; null with no tensors.
    pub first_tensor_ms: Option<f64>,
    /// Sum of one byte per page of every tensor: depends on the file's bytes only.
    pub checksum: u64,
}

/// What is benchmarked and how, fixed before the first run.
pub(super) struct Setup<'a> {
    pub uris: &'a [String],
    pub files: usize,
    pub bytes: u64,
    pub tensors: usize,
    pub device: &'a Device,
    /// Every configuration run (one unless sweeping), resolved.
    pub configs: Vec<Resolved>,
    pub repeat: u32,
    /// "cold", "warm" or both, in the order they run.
    pub modes: Vec<&'static str>,
    pub sweep: bool,
}

/// One cache mode's best run beside the limit that applies to it.
#[derive(Serialize, Clone, Debug, Default)]
pub(super) struct ModeReport {
    pub best_run: usize,
    pub best_gb_per_s: f64,
    /// Cold only: whether eviction took effect (false on e.g. tmpfs: the runs read memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evicted: Option<bool>,
    /// The name of the lowest measurable limit that applies (a key of `limits`), if any.
    pub limit: Option<&'static str>,
    pub limit_gb_per_s: Option<f64>,
    /// best_gb_per_s / limit_gb_per_s.
    pub fraction_of_limit: Option<f64>,
    /// The limit's name when fastload reaches at least [`BOUND`] of it, [`AT_LIMIT`] when the
    /// best run is above the limit (the limit is the best of as many passes as there were runs,
    /// so that is the measurements' noise, not fastload beating the storage), else "fastload".
    pub bound_by: &'static str,
}

/// The fraction of a limit from which that limit is said to bind.
pub(super) const BOUND: f64 = 0.8;

/// `bound_by` of a best run above its limit.
pub(super) const AT_LIMIT: &str = "at the limit (noise)";

impl ModeReport {
    /// `applicable`: the limits that apply to this mode (measured or not).
    pub fn new(
        runs: &[&RunReport],
        evicted: Option<bool>,
        limits: &BTreeMap<&'static str, Limit>,
        applicable: &[&'static str],
    ) -> ModeReport {
        let best = best(runs);
        let binding = applicable
            .iter()
            .filter_map(|&name| Some((name, limits.get(name)?.gb_per_s?)))
            .reduce(|a, b| if b.1 < a.1 { b } else { a });
        let fraction = binding.map(|(_, rate)| best.gb_per_s / rate.max(1e-12));
        ModeReport {
            best_run: best.run,
            best_gb_per_s: best.gb_per_s,
            evicted,
            limit: binding.map(|b| b.0),
            limit_gb_per_s: binding.map(|b| b.1),
            fraction_of_limit: fraction,
            bound_by: match (binding, fraction) {
                (Some(_), Some(f)) if f > 1.0 => AT_LIMIT,
                (Some((name, _)), Some(f)) if f >= BOUND => name,
                _ => "fastload",
            },
        }
    }
}

/// Seconds as a person reads them: "1.234 s", "12.3 ms", "0.042 ms" (a tiny file loads in far
/// less than a millisecond, which "0.000 s" hid).
fn duration(seconds: f64) -> String {
    if seconds >= 1.0 {
        format!("{seconds:.3} s")
    } else if seconds >= 0.01 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{:.3} ms", seconds * 1e3)
    }
}

#[derive(Serialize)]
struct Grid {
    concurrency: Vec<usize>,
    block_size: Vec<u64>,
}

#[derive(Serialize)]
struct Report<'a> {
    uris: Vec<String>,
    files: usize,
    bytes: u64,
    tensors: usize,
    device: String,
    /// As requested (after FASTLOAD_METHOD); `method_used` is what the loader picked.
    method: &'static str,
    method_used: &'static str,
    /// Of the best run when sweeping.
    concurrency: usize,
    block_size: u64,
    memory_limit: u64,
    /// True when cold runs were made (the headline `best_*` is then the cold one).
    cold: bool,
    repeat: u32,
    sweep: Option<Grid>,
    runs: &'a [RunReport],
    best_run: usize,
    best_gb_per_s: f64,
    checksum: u64,
    limits: &'a BTreeMap<&'static str, Limit>,
    modes: &'a BTreeMap<&'static str, ModeReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    compare: Option<&'a Compare>,
}

fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// The values of one sweep axis, in grid order.
fn distinct<T: PartialEq>(values: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for v in values {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// The fastest run (the first of equals).
pub(super) fn best<'a, R: std::borrow::Borrow<RunReport> + 'a>(runs: &'a [R]) -> &'a RunReport {
    runs.iter()
        .map(|r| r.borrow())
        .reduce(|best, r| if r.gb_per_s > best.gb_per_s { r } else { best })
        .expect("at least one run")
}

impl Setup<'_> {
    /// The URIs as the report shows them: without credentials (a URL's password, a presigned
    /// URL's signature), which the table and `--json` would otherwise print.
    fn shown_uris(&self) -> Vec<String> {
        self.uris.iter().map(|u| crate::error::scrub(u)).collect()
    }

    fn runs(&self) -> usize {
        self.configs.len() * self.repeat as usize
    }

    /// What runs, then the table's header.
    pub fn intro(&self) -> String {
        let first = &self.configs[0];
        let config = if self.sweep {
            String::new()
        } else {
            format!(
                ", concurrency {}, block size {}",
                first.concurrency,
                Size(first.block_size)
            )
        };
        format!(
            "fastload bench: {} ({}, {}) from {}\n\
             device {}, method {}{config}, memory limit {}, {} page cache, {}\n\n{}",
            decimal_bytes(self.bytes),
            plural(self.files, "file"),
            plural(self.tensors, "tensor"),
            self.shown_uris().join(" "),
            self.device,
            first.method.as_str(),
            Size(first.memory_limit),
            self.modes.join(", then "),
            plural(self.runs(), "run"),
            self.header_row()
        )
    }

    fn config_cells(&self, concurrency: &str, block_size: &str) -> String {
        if self.sweep {
            format!("{concurrency:>11}  {block_size:>10}  ")
        } else {
            String::new()
        }
    }

    fn header_row(&self) -> String {
        format!(
            "{:>4}  {:>5}  {}{:>14}  {:>8}  {:>8}  {:>7}  {:>12}\n",
            "run",
            "cache",
            self.config_cells("concurrency", "block size"),
            "bytes",
            "tensors",
            "seconds",
            "GB/s",
            "first tensor"
        )
    }

    /// Fixed-width, so each row can be printed as soon as its run ends.
    pub fn row(&self, r: &RunReport) -> String {
        let first = r
            .first_tensor_ms
            .map_or_else(|| "-".into(), |ms| format!("{ms:.2} ms"));
        let config = self.config_cells(&r.concurrency.to_string(), &Size(r.block_size).to_string());
        format!(
            "{:>4}  {:>5}  {config}{:>14}  {:>8}  {:>8.4}  {:>7.3}  {first:>12}\n",
            r.run, r.cache, r.bytes, r.tensors, r.seconds, r.gb_per_s
        )
    }

    /// The limits measured, then each mode's best run beside its limit.
    pub fn summary(
        &self,
        runs: &[RunReport],
        limits: &BTreeMap<&'static str, Limit>,
        modes: &BTreeMap<&'static str, ModeReport>,
    ) -> String {
        let mut out = self.limits_table(limits);
        out.push('\n');
        for mode in &self.modes {
            let Some(m) = modes.get(mode) else { continue };
            let run = &runs[m.best_run - 1];
            let label = if self.modes.len() == 1 {
                "best".to_string()
            } else {
                format!("best {mode}")
            };
            out.push_str(&self.best_line(&label, run));
            if m.evicted == Some(false) {
                out.push_str(
                    "  (eviction did not take effect here, e.g. tmpfs: these runs read memory)\n",
                );
            }
            match (m.limit, m.fraction_of_limit) {
                (Some(limit), Some(f)) => out.push_str(&format!(
                    "  {:.0}% of {limit} ({:.3} GB/s): {}\n",
                    f * 100.0,
                    m.limit_gb_per_s.unwrap_or(0.0),
                    if m.bound_by == AT_LIMIT {
                        AT_LIMIT.to_string()
                    } else {
                        format!("bound by {}", m.bound_by)
                    }
                )),
                _ => out.push_str("  no limit measurable here to compare with\n"),
            }
        }
        out
    }

    /// The limits measured, one per line (nothing when there are none).
    pub fn limits_table(&self, limits: &BTreeMap<&'static str, Limit>) -> String {
        let mut out = String::new();
        if !limits.is_empty() {
            out.push_str("\nlimits, measured just now on the same files:\n");
            for (name, limit) in limits {
                let rate = limit
                    .gb_per_s
                    .map_or_else(|| "-".into(), |r| format!("{r:.3} GB/s"));
                out.push_str(&format!("  {name:<17} {rate:>12}  {}\n", limit.what));
            }
        }
        out
    }

    /// `--limits-only --json`: the files and their limits, on one line.
    pub fn limits_json(&self, limits: &BTreeMap<&'static str, Limit>) -> String {
        #[derive(Serialize)]
        struct Limits<'a> {
            uris: Vec<String>,
            files: usize,
            bytes: u64,
            limits: &'a BTreeMap<&'static str, Limit>,
        }
        let report = Limits {
            uris: self.shown_uris(),
            files: self.files,
            bytes: self.bytes,
            limits,
        };
        let mut text = serde_json::to_string(&report).expect("the limits serialize");
        text.push('\n');
        text
    }

    fn best_line(&self, label: &str, best: &RunReport) -> String {
        let first = best
            .first_tensor_ms
            .map_or_else(String::new, |ms| format!(", first tensor {ms:.2} ms"));
        let config = if self.sweep {
            format!(
                ", concurrency {}, block size {}",
                best.concurrency,
                Size(best.block_size)
            )
        } else {
            String::new()
        };
        format!(
            "{label}: run {} (method {}{config}): {:.3} GB/s, {}{first}\n",
            best.run,
            best.method,
            best.gb_per_s,
            duration(best.seconds)
        )
    }

    /// The `--json` object, on one line.
    pub fn json(
        &self,
        runs: &[RunReport],
        limits: &BTreeMap<&'static str, Limit>,
        modes: &BTreeMap<&'static str, ModeReport>,
        compare: Option<&Compare>,
    ) -> String {
        let best = &runs[modes[self.modes[0]].best_run - 1];
        let first = &self.configs[0];
        let report = Report {
            uris: self.shown_uris(),
            files: self.files,
            bytes: best.bytes,
            tensors: best.tensors,
            device: self.device.to_string(),
            method: first.method.as_str(),
            method_used: best.method,
            concurrency: best.concurrency,
            block_size: best.block_size,
            memory_limit: first.memory_limit,
            cold: self.modes.contains(&"cold"),
            repeat: self.repeat,
            sweep: self.sweep.then(|| Grid {
                concurrency: distinct(self.configs.iter().map(|c| c.concurrency)),
                block_size: distinct(self.configs.iter().map(|c| c.block_size)),
            }),
            runs,
            best_run: best.run,
            best_gb_per_s: best.gb_per_s,
            checksum: best.checksum,
            limits,
            modes,
            compare,
        };
        let mut text = serde_json::to_string(&report).expect("the report serializes");
        text.push('\n');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: usize, gb_per_s: f64) -> RunReport {
        RunReport {
            run: n,
            cache: "warm",
            concurrency: 16,
            block_size: 8 << 20,
            method: "mmap",
            bytes: 1000,
            tensors: 2,
            seconds: 1000.0 / gb_per_s / 1e9,
            gb_per_s,
            first_tensor_ms: Some(1.5),
            checksum: 7,
        }
    }

    #[test]
    fn picks_the_first_fastest_run() {
        let runs = [run(1, 1.0), run(2, 3.0), run(3, 3.0), run(4, 2.0)];
        assert_eq!(best(&runs).run, 2);
    }

    #[test]
    fn the_lowest_measured_limit_binds_from_80_percent() {
        let mut limits = BTreeMap::new();
        let limit = |r: Option<f64>| Limit {
            gb_per_s: r,
            what: String::new(),
            bytes: 0,
        };
        limits.insert("page_cache", limit(Some(2.0)));
        limits.insert("host_to_device", limit(Some(4.0)));
        limits.insert("storage_direct", limit(None));
        let runs = [run(1, 1.0), run(2, 1.7)];
        let refs: Vec<&RunReport> = runs.iter().collect();
        let m = ModeReport::new(&refs, None, &limits, &["page_cache", "host_to_device"]);
        assert_eq!(
            (m.best_run, m.limit, m.bound_by),
            (2, Some("page_cache"), "page_cache")
        );
        assert!((m.fraction_of_limit.unwrap() - 0.85).abs() < 1e-9);
        let m = ModeReport::new(&refs[..1], None, &limits, &["host_to_device"]);
        assert_eq!((m.limit, m.bound_by), (Some("host_to_device"), "fastload"));
        let m = ModeReport::new(&refs, None, &limits, &["storage_direct"]);
        assert_eq!(
            (m.limit, m.fraction_of_limit, m.bound_by),
            (None, None, "fastload")
        );
        // Above the limit: noise in the measurements, never "bound by" it.
        let fast = [run(1, 2.4)];
        let refs: Vec<&RunReport> = fast.iter().collect();
        let m = ModeReport::new(&refs, None, &limits, &["page_cache"]);
        assert_eq!((m.limit, m.bound_by), (Some("page_cache"), AT_LIMIT));
    }

    #[test]
    fn durations_never_read_zero() {
        assert_eq!(duration(2.5), "2.500 s");
        assert_eq!(duration(0.0425), "42.5 ms");
        assert_eq!(duration(0.000042), "0.042 ms");
    }

    #[test]
    fn rows_line_up_with_the_header() {
        let setup = Setup {
            uris: &["m.safetensors".to_string()],
            files: 1,
            bytes: 1000,
            tensors: 2,
            device: &Device::Cpu,
            configs: vec![],
            repeat: 1,
            modes: vec!["warm"],
            sweep: true,
        };
        let header = setup.header_row();
        let row = setup.row(&run(1, 2.0));
        assert_eq!(header.len(), row.len(), "{header}{row}");
        assert!(row.contains("8MiB") && row.contains("1.50 ms"));
        assert_eq!(distinct([4, 8, 4, 8].into_iter()), vec![4, 8]);
    }
}
