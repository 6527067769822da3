//! What `fastload bench` prints: the human table (rows printed as runs end) and the one JSON
//! object of `--json`.

use serde::Serialize;

use super::{decimal_bytes, Device};
use crate::options::{Resolved, Size};

/// One timed load.
#[derive(Serialize, Clone, Debug)]
pub(super) struct RunReport {
    /// 1-based, in the order the runs happened.
    pub run: usize,
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
    pub cold: bool,
    pub sweep: bool,
}

#[derive(Serialize)]
struct Grid {
    concurrency: Vec<usize>,
    block_size: Vec<u64>,
}

#[derive(Serialize)]
struct Report<'a> {
    uris: &'a [String],
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
    cold: bool,
    repeat: u32,
    sweep: Option<Grid>,
    runs: &'a [RunReport],
    best_run: usize,
    best_gb_per_s: f64,
    checksum: u64,
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
pub(super) fn best(runs: &[RunReport]) -> &RunReport {
    runs.iter()
        .reduce(|best, r| if r.gb_per_s > best.gb_per_s { r } else { best })
        .expect("at least one run")
}

impl Setup<'_> {
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
            self.uris.join(" "),
            self.device,
            first.method.as_str(),
            Size(first.memory_limit),
            if self.cold { "cold" } else { "warm" },
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
            "{:>4}  {}{:>14}  {:>8}  {:>8}  {:>7}  {:>12}\n",
            "run",
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
            "{:>4}  {config}{:>14}  {:>8}  {:>8.4}  {:>7.3}  {first:>12}\n",
            r.run, r.bytes, r.tensors, r.seconds, r.gb_per_s
        )
    }

    /// The line under the table.
    pub fn summary(&self, runs: &[RunReport]) -> String {
        let best = best(runs);
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
            "\nbest: run {} (method {}{config}): {:.3} GB/s, {:.3} s{first}\n",
            best.run, best.method, best.gb_per_s, best.seconds
        )
    }

    /// The `--json` object, on one line.
    pub fn json(&self, runs: &[RunReport]) -> String {
        let best = best(runs);
        let first = &self.configs[0];
        let report = Report {
            uris: self.uris,
            files: self.files,
            bytes: best.bytes,
            tensors: best.tensors,
            device: self.device.to_string(),
            method: first.method.as_str(),
            method_used: best.method,
            concurrency: best.concurrency,
            block_size: best.block_size,
            memory_limit: first.memory_limit,
            cold: self.cold,
            repeat: self.repeat,
            sweep: self.sweep.then(|| Grid {
                concurrency: distinct(self.configs.iter().map(|c| c.concurrency)),
                block_size: distinct(self.configs.iter().map(|c| c.block_size)),
            }),
            runs,
            best_run: best.run,
            best_gb_per_s: best.gb_per_s,
            checksum: best.checksum,
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
    fn rows_line_up_with_the_header() {
        let setup = Setup {
            uris: &["m.safetensors".to_string()],
            files: 1,
            bytes: 1000,
            tensors: 2,
            device: &Device::Cpu,
            configs: vec![],
            repeat: 1,
            cold: false,
            sweep: true,
        };
        let header = setup.header_row();
        let row = setup.row(&run(1, 2.0));
        assert_eq!(header.len(), row.len(), "{header}{row}");
        assert!(row.contains("8MiB") && row.contains("1.50 ms"));
        assert_eq!(distinct([4, 8, 4, 8].into_iter()), vec![4, 8]);
    }
}
