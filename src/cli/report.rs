//! What `fastload bench` prints: the human table (rows printed as runs end) and the one JSON
//! object of `--json`.

use std::collections::BTreeMap;

use serde::Serialize;

use super::compare::Compare;
use super::limits::Limit;
use super::run::RunReport;
use super::verdict::ModeReport;
use super::{decimal_bytes, plural, Device};
use crate::options::{Resolved, Size};

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
    /// Some URIs name objects (read over the network).
    pub remote: bool,
    /// Of `files`, those on this machine.
    pub local_files: usize,
    /// `--cache DIR` (or `FASTLOAD_CACHE`): where the local copy of remote objects goes.
    pub cache_dir: Option<String>,
    /// The checkpoint is the generated one (no URI), kept on disk for later runs.
    pub generated: bool,
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
    /// Copy queues of a staged load (`--copy-streams`); `None` on the CPU, which copies nothing
    /// (as `stats()["copy_streams"]`).
    copy_streams: Option<usize>,
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

impl Setup<'_> {
    /// The URIs as the report shows them: without credentials (a URL's password, a presigned
    /// URL's signature), which the table and `--json` would otherwise print.
    fn shown_uris(&self) -> Vec<String> {
        self.uris.iter().map(|u| crate::error::scrub(u)).collect()
    }

    /// The copy queues of a staged run; `None` on the CPU.
    fn copy_streams(&self) -> Option<usize> {
        (*self.device != Device::Cpu).then_some(self.configs[0].copy_streams)
    }

    fn runs(&self) -> usize {
        self.configs.len() * self.repeat as usize
    }

    /// "3 runs", or "3 runs per mode" above the rows of cold and warm runs.
    fn runs_per_mode(&self) -> String {
        let runs = plural(self.runs(), "run");
        if self.modes.len() > 1 {
            format!("{runs} per mode")
        } else {
            runs
        }
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
        let streams = match self.copy_streams() {
            Some(n) if n > 1 => format!(" ({n} copy streams)"),
            _ => String::new(),
        };
        let kept = if self.generated {
            "(generated once and kept there for later runs; `fastload bench --clean` removes it)\n"
        } else {
            ""
        };
        format!(
            "fastload bench: {} ({}, {}) from {}\n{kept}\
             device {}{streams}, method {}{config}, memory limit {}, {}, {}\n\n{}",
            decimal_bytes(self.bytes),
            plural(self.files, "file"),
            plural(self.tensors, "tensor"),
            self.shown_uris().join(" "),
            self.device,
            first.method.as_str(),
            Size(first.memory_limit),
            self.reads(),
            self.runs_per_mode(),
            self.header_row()
        )
    }

    /// What the runs read: the page cache's state for local files; objects come over the
    /// network (or from the local copy `--cache` keeps) whatever the mode.
    fn reads(&self) -> String {
        let local = format!("{} page cache", self.modes.join(", then "));
        if !self.remote {
            return local;
        }
        let objects = match &self.cache_dir {
            None => "objects read over the network every run".to_string(),
            Some(dir) => format!(
                "objects read over the network until a local copy is in {dir} (--cache), then \
                 from that copy"
            ),
        };
        if self.local_files > 0 {
            format!("{objects}; local files: {local}")
        } else {
            objects
        }
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
            "{:>4}  {:<10}  {}{:>14}  {:>8}  {:>8}  {:>7}  {:>12}\n",
            "run",
            "read from",
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
            "{:>4}  {:<10}  {config}{:>14}  {:>8}  {:>8.4}  {:>7.3}  {first:>12}\n",
            r.run,
            r.read_from.label(),
            r.bytes,
            r.tensors,
            r.seconds,
            r.gb_per_s
        )
    }

    /// The limits measured, then each mode's best run (per source, when its runs read from
    /// several) and what bounds it.
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
            let label = mode.to_string();
            let parts = if m.by_source.is_empty() {
                std::slice::from_ref(m)
            } else {
                &m.by_source[..]
            };
            for part in parts {
                let run = &runs[part.best_run - 1];
                let label = if m.by_source.is_empty() {
                    label.clone()
                } else {
                    format!("{label} ({} runs)", part.read_from.label())
                };
                out.push_str(&self.best_line(&label, part, run));
                out.push_str(&part.sentence(run.method, limits));
                out.push_str(&self.first_tensor_note(run));
            }
            if m.evicted == Some(false) {
                out.push_str(
                    "  (eviction did not take effect here, e.g. tmpfs: the cold runs read memory)\n",
                );
            }
        }
        out
    }

    /// Why the first tensor came late, when it came after half the load: tensors are handed out
    /// a segment at a time (a staged load's once the segment's copies finished), so a checkpoint
    /// of few segments has its first tensor near the end.
    fn first_tensor_note(&self, run: &RunReport) -> String {
        let Some(ms) = run.first_tensor_ms else {
            return String::new();
        };
        let share = ms / (run.seconds * 1e3).max(1e-9);
        // Below 10 ms the fixed costs of a load blur the picture.
        if share < 0.5 || run.seconds < 0.01 {
            return String::new();
        }
        let config = &self.configs[0];
        let staged = match self.device {
            Device::Cpu => String::new(),
            device => format!(" once its copies to {device} finished"),
        };
        format!(
            "  first tensor at {:.0}% of the load: tensors are handed out a segment (up to {}) at \
             a time{staged}, and this load is {}\n",
            share.min(1.0) * 100.0,
            Size(crate::plan::segment_size(
                config.memory_limit,
                run.block_size
            )),
            plural(run.segments, "segment")
        )
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

    /// A mode's runs: their spread (min, median, max: the verdict judges the median), then
    /// the best run.
    fn best_line(&self, label: &str, m: &ModeReport, best: &RunReport) -> String {
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
        let rates = if m.runs > 1 {
            format!(
                "{:.3} / {:.3} / {:.3} GB/s (min / median / max); best: ",
                m.min_gb_per_s, m.median_gb_per_s, m.best_gb_per_s
            )
        } else {
            String::new()
        };
        format!(
            "{label}, {}: {rates}run {} ({}, method {}{config}): {:.3} GB/s, {}{first}\n",
            plural(m.runs, "run"),
            best.run,
            best.read_from.label(),
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
            copy_streams: self.copy_streams(),
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
    use super::super::run::{best, sample_run, ReadFrom};
    use super::*;

    fn run(n: usize, gb_per_s: f64) -> RunReport {
        sample_run(n, gb_per_s, ReadFrom::PageCache, "mmap")
    }

    #[test]
    fn picks_the_first_fastest_run() {
        let runs = [run(1, 1.0), run(2, 3.0), run(3, 3.0), run(4, 2.0)];
        assert_eq!(best(&runs).run, 2);
    }

    #[test]
    fn durations_never_read_zero() {
        assert_eq!(duration(2.5), "2.500 s");
        assert_eq!(duration(0.0425), "42.5 ms");
        assert_eq!(duration(0.000042), "0.042 ms");
    }

    fn setup<'a>(uris: &'a [String], device: &'a Device, remote: bool) -> Setup<'a> {
        Setup {
            uris,
            files: 1,
            bytes: 1000,
            tensors: 2,
            device,
            configs: vec![Resolved {
                concurrency: 16,
                block_size: 8 << 20,
                memory_limit: 1 << 30,
                method: crate::Method::Auto,
                method_reason: String::new(),
                copy_streams: 1,
                staged_block_size: 8 << 20,
            }],
            repeat: 1,
            modes: vec!["warm"],
            sweep: false,
            remote,
            local_files: usize::from(!remote),
            cache_dir: None,
            generated: false,
        }
    }

    #[test]
    fn rows_line_up_with_the_header() {
        let uris = ["m.safetensors".to_string()];
        let mut setup = setup(&uris, &Device::Cpu, false);
        setup.sweep = true;
        let header = setup.header_row();
        let row = setup.row(&run(1, 2.0));
        assert_eq!(header.len(), row.len(), "{header}{row}");
        assert!(row.contains("8MiB") && row.contains("1.50 ms"));
        // Where the run read from, under a name `--cache` cannot be confused with.
        assert!(
            header.contains("read from") && !header.contains("cache"),
            "{header}"
        );
        assert!(row.contains("  page cache  "), "{row}");
        assert_eq!(distinct([4, 8, 4, 8].into_iter()), vec![4, 8]);
    }

    #[test]
    fn the_intro_says_what_the_runs_read() {
        let local = ["m.safetensors".to_string()];
        let mut s = setup(&local, &Device::Cpu, false);
        s.modes = vec!["cold", "warm"];
        assert!(s
            .intro()
            .contains("memory limit 1GiB, cold, then warm page cache, 1 run per mode\n"));
        s.modes = vec!["warm"];
        s.repeat = 3;
        assert!(s.intro().contains("warm page cache, 3 runs\n"));
        assert!(!s.intro().contains("--clean"));
        // The generated checkpoint stays on disk: the intro says how to remove it.
        s.generated = true;
        assert!(s.intro().contains(
            "(generated once and kept there for later runs; `fastload bench --clean` removes it)"
        ));
        // Objects are never "warm page cache".
        let remote = ["s3://b/m.safetensors".to_string()];
        let mut s = setup(&remote, &Device::Cpu, true);
        let intro = s.intro();
        assert!(
            intro.contains("objects read over the network every run"),
            "{intro}"
        );
        assert!(!intro.contains("page cache"), "{intro}");
        s.cache_dir = Some("/c".into());
        let intro = s.intro();
        assert!(
            intro.contains("until a local copy is in /c (--cache), then from that copy"),
            "{intro}"
        );
    }

    #[test]
    fn a_cache_run_says_it_read_the_local_copy() {
        let remote = ["s3://b/m.safetensors".to_string()];
        let mut s = setup(&remote, &Device::Cpu, true);
        s.cache_dir = Some("/c".into());
        s.repeat = 2;
        let mut first = run(1, 0.45);
        (first.read_from, first.method) = (ReadFrom::Network, "read");
        let mut second = run(2, 3.0);
        second.read_from = ReadFrom::LocalCopy;
        let runs = vec![first, second];
        assert!(s.row(&runs[0]).contains("network") && s.row(&runs[1]).contains("local copy"));
        let limits: BTreeMap<_, _> = [(
            "ranged_get",
            Limit {
                gb_per_s: Some(0.5),
                what: String::new(),
                bytes: 0,
            },
        )]
        .into();
        let refs: Vec<&RunReport> = runs.iter().collect();
        let modes = [(
            "warm",
            ModeReport::new(&refs, None, &limits, &["ranged_get"]),
        )]
        .into();
        let text = s.summary(&runs, &limits, &modes);
        for want in [
            "warm (network runs), 1 run: run 1 (network, method read)",
            "streamed over the network into buffers: 90% of ranged_get (0.500 GB/s): bound by \
             ranged_get",
            "warm (local copy runs), 1 run: run 2 (local copy, method mmap)",
            "mapped, nothing copied: bound by mapping and first touch",
        ] {
            assert!(text.contains(want), "{want:?} not in {text}");
        }
    }

    #[test]
    fn several_runs_show_their_spread() {
        let uris = ["m.safetensors".to_string()];
        let mut s = setup(&uris, &Device::Cpu, false);
        s.repeat = 3;
        let runs = vec![run(1, 0.82), run(2, 1.5), run(3, 1.1)];
        let refs: Vec<&RunReport> = runs.iter().collect();
        let modes = [("warm", ModeReport::new(&refs, None, &BTreeMap::new(), &[]))].into();
        let text = s.summary(&runs, &BTreeMap::new(), &modes);
        assert!(
            text.starts_with(
                "\nwarm, 3 runs: 0.820 / 1.100 / 1.500 GB/s (min / median / max); best: run 2 \
                 (page cache, method mmap): 1.500 GB/s"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_late_first_tensor_is_explained() {
        let uris = ["m.safetensors".to_string()];
        let s = setup(&uris, &Device::Host, false);
        let mut r = run(1, 1.0);
        r.seconds = 0.05;
        r.first_tensor_ms = Some(r.seconds * 1e3 * 0.97);
        let note = s.first_tensor_note(&r);
        assert!(
            note.contains(
                "first tensor at 97% of the load: tensors are handed out a segment (up \
                           to 64MiB) at a time once its copies to host finished, and this load is \
                           1 segment"
            ),
            "{note}"
        );
        r.first_tensor_ms = Some(r.seconds * 1e3 * 0.1);
        assert_eq!(s.first_tensor_note(&r), "");
        // A load of a millisecond: its fixed costs, nothing to explain.
        (r.seconds, r.first_tensor_ms) = (0.001, Some(0.97));
        assert_eq!(s.first_tensor_note(&r), "");
    }
}
