//! What bounds a `fastload bench` result: where each run read its bytes from, which of the
//! measured limits applies to it, and the sentence the summary prints.
//!
//! A limit bounds only the runs that do what it measures: the storage limits bound runs that read
//! the storage (evicted files), `ranged_get` runs that read the network, `page_cache` (a copy out
//! of the page cache) runs that copy out of it. A mapped run from memory copies nothing, so no
//! copy rate bounds it: mapping and first touch of every page do (`mapped_touch`).
//!
//! The runs of a mode spread (tens of percent on a shared machine): the verdict judges their
//! median, and the summary shows min, median and max beside it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::limits::Limit;
use super::run::{best, ReadFrom, RunReport};

impl ReadFrom {
    /// As the table's "read from" column shows it (`--json` writes `read_from` in snake case).
    pub fn label(self) -> &'static str {
        match self {
            ReadFrom::Storage => READ_FROM_LABELS[0],
            ReadFrom::PageCache => READ_FROM_LABELS[1],
            ReadFrom::Network => READ_FROM_LABELS[2],
            ReadFrom::LocalCopy => READ_FROM_LABELS[3],
        }
    }

    /// Where a run read from: `local` of the plan's `shards` were files on this machine (a
    /// cached copy counts), `files` of them are the local files named on the command line, and
    /// `evicted` says whether they were evicted before the run.
    pub fn of_run(shards: usize, local: usize, files: usize, evicted: bool) -> ReadFrom {
        if local < shards {
            ReadFrom::Network
        } else if files < shards {
            ReadFrom::LocalCopy
        } else if evicted {
            ReadFrom::Storage
        } else {
            ReadFrom::PageCache
        }
    }
}

// The labels below are the ones docs/cli-bench.md explains; scripts/check_docs.py reads them
// from here (each `const ...: ... = "..."` string and the `READ_FROM_LABELS` list) and checks
// that the page names every one and shows no other.

/// The table's "read from" column.
pub(super) const READ_FROM_LABELS: [&str; 4] = ["storage", "page cache", "network", "local copy"];

/// `bound_by` below [`BOUND`] of the applicable limit: fastload's own work.
pub(super) const FASTLOAD: &str = "fastload";
/// `bound_by` of a mapped run from memory when `mapped_touch` could not be measured: nothing is
/// copied, so no copy rate bounds it.
pub(super) const MAPPING: &str = "mapping and first touch";
/// `bound_by` of a run far above (more than [`NOISE`] times) the limit that applies: that
/// measurement ran low; never "noise".
pub(super) const ABOVE: &str = "above the limit measured";
/// `bound_by` when no limit that applies could be measured here.
pub(super) const UNMEASURED: &str = "no limit measured";

/// The fraction of a limit from which that limit is said to bind.
pub(super) const BOUND: f64 = 0.8;
/// Up to this multiple of a limit a run is at the limit, within the measurements' noise (a
/// limit is the best of as many passes as there were runs, and a single pass on a shared
/// machine moves by tens of percent); beyond it the measurement of the limit ran low.
pub(super) const NOISE: f64 = 1.25;

/// Whether the limit `name` bounds a run reading from `from` with `method`.
fn applies(name: &str, from: ReadFrom, method: &str) -> bool {
    match name {
        "storage_direct" | "storage_buffered" => from == ReadFrom::Storage,
        "ranged_get" => from == ReadFrom::Network,
        // The copy rate out of the page cache: a mapped load copies nothing.
        "page_cache" => from == ReadFrom::PageCache && method != "mmap",
        // Mapping and touching every page: what a mapped load from memory does.
        "mapped_touch" => from == ReadFrom::PageCache && method == "mmap",
        // host_to_device: every staged load copies into the device.
        _ => true,
    }
}

/// The lowest and the median rate of `runs` (the mean of the middle two of an even count).
fn spread(runs: &[&RunReport]) -> (f64, f64) {
    let mut rates: Vec<f64> = runs.iter().map(|r| r.gb_per_s).collect();
    rates.sort_by(f64::total_cmp);
    let n = rates.len();
    let median = if n % 2 == 1 {
        rates[n / 2]
    } else {
        (rates[n / 2 - 1] + rates[n / 2]) / 2.0
    };
    (rates[0], median)
}

/// Some runs (a cache mode's, of one source): their best and their spread, and the median beside
/// the limit that bounds it.
#[derive(Serialize, Clone, Debug)]
pub(super) struct ModeReport {
    pub best_run: usize,
    pub best_gb_per_s: f64,
    /// How many runs, and their spread: the verdict judges the median.
    pub runs: usize,
    pub min_gb_per_s: f64,
    pub median_gb_per_s: f64,
    /// Where the best run read from.
    pub read_from: ReadFrom,
    /// Cold only: whether eviction took effect (false on e.g. tmpfs: the runs read memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evicted: Option<bool>,
    /// The name of the lowest measured limit that applies to the best run (a key of `limits`).
    pub limit: Option<&'static str>,
    pub limit_gb_per_s: Option<f64>,
    /// median_gb_per_s / limit_gb_per_s.
    pub fraction_of_limit: Option<f64>,
    /// What bounds the runs (their median): the limit's name (from [`BOUND`] to [`NOISE`] of it),
    /// [`FASTLOAD`], [`ABOVE`], [`MAPPING`] or [`UNMEASURED`].
    pub bound_by: &'static str,
    /// One report per source when the mode's runs read from more than one (with `--cache`: the
    /// network, then the local copy); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_source: Vec<ModeReport>,
}

impl ModeReport {
    /// The report of one mode's `runs`: of its best run, with one report per source when they
    /// read from several. `measured`: the limits measured for this mode (they apply or not,
    /// run by run).
    pub fn new(
        runs: &[&RunReport],
        evicted: Option<bool>,
        limits: &BTreeMap<&'static str, Limit>,
        measured: &[&'static str],
    ) -> ModeReport {
        let mut sources: Vec<ReadFrom> = Vec::new();
        for r in runs {
            if !sources.contains(&r.read_from) {
                sources.push(r.read_from);
            }
        }
        let mut report = ModeReport::of(runs, evicted, limits, measured);
        if sources.len() > 1 {
            report.by_source = sources
                .into_iter()
                .map(|from| {
                    let mine: Vec<&RunReport> = runs
                        .iter()
                        .copied()
                        .filter(|r| r.read_from == from)
                        .collect();
                    ModeReport::of(&mine, evicted, limits, measured)
                })
                .collect();
        }
        report
    }

    fn of(
        runs: &[&RunReport],
        evicted: Option<bool>,
        limits: &BTreeMap<&'static str, Limit>,
        measured: &[&'static str],
    ) -> ModeReport {
        let best = best(runs);
        let (min, median) = spread(runs);
        let binding = measured
            .iter()
            .filter(|&&name| applies(name, best.read_from, best.method))
            .filter_map(|&name| Some((name, limits.get(name)?.gb_per_s?)))
            .reduce(|a, b| if b.1 < a.1 { b } else { a });
        let fraction = binding.map(|(_, rate)| median / rate.max(1e-12));
        let from_memory = matches!(best.read_from, ReadFrom::PageCache | ReadFrom::LocalCopy);
        let bound_by = match (binding, fraction) {
            (Some(_), Some(f)) if f > NOISE => ABOVE,
            (Some((name, _)), Some(f)) if f >= BOUND => name,
            (Some(_), Some(_)) => FASTLOAD,
            _ if best.method == "mmap" && from_memory => MAPPING,
            _ => UNMEASURED,
        };
        ModeReport {
            best_run: best.run,
            best_gb_per_s: best.gb_per_s,
            runs: runs.len(),
            min_gb_per_s: min,
            median_gb_per_s: median,
            read_from: best.read_from,
            evicted,
            limit: binding.map(|b| b.0),
            limit_gb_per_s: binding.map(|b| b.1),
            fraction_of_limit: fraction,
            bound_by,
            by_source: Vec::new(),
        }
    }

    /// The summary's line under the best run: what the run did and what bounds it. `limits`
    /// gives the page-cache copy rate that a mapped run is shown beside (not bounded by).
    pub fn sentence(&self, method: &str, limits: &BTreeMap<&'static str, Limit>) -> String {
        // Several runs are judged by their median.
        let median = if self.runs > 1 { "median " } else { "" };
        let of_limit = |name: &str, rate: f64, f: f64| {
            format!("{median}{:.0}% of {name} ({rate:.3} GB/s)", f * 100.0)
        };
        let how = match (self.read_from, method) {
            (ReadFrom::Storage, "mmap") => "mapped, pages read from storage on first touch",
            (ReadFrom::Storage, "direct") => "read from storage around the page cache into buffers",
            (ReadFrom::Storage, _) => "read from storage into buffers",
            (ReadFrom::PageCache | ReadFrom::LocalCopy, "mmap") => "mapped, nothing copied",
            (ReadFrom::PageCache, _) => "copied out of the page cache",
            (ReadFrom::LocalCopy, _) => "copied out of the local copy",
            (ReadFrom::Network, _) => "streamed over the network into buffers",
        };
        let verdict = match (self.limit, self.limit_gb_per_s, self.fraction_of_limit) {
            (Some(name), Some(rate), Some(f)) => {
                let share = of_limit(name, rate, f);
                match self.bound_by {
                    ABOVE => format!(
                        "{share}: {f:.1}x the limit, far more than noise: that measurement of \
                         {name} ran low here (rerun, or raise --repeat)"
                    ),
                    FASTLOAD => format!("{share}: bound by fastload, below what {name} allows"),
                    _ if f > 1.0 => {
                        format!("{share}: bound by {name} (at the limit, within noise)")
                    }
                    _ => format!("{share}: bound by {name}"),
                }
            }
            _ if self.bound_by == MAPPING => {
                let copy = limits
                    .get("page_cache")
                    .and_then(|l| l.gb_per_s)
                    .filter(|_| self.read_from == ReadFrom::PageCache)
                    .map(|rate| {
                        format!(
                            ", not by page_cache ({rate:.3} GB/s, a copy rate; the {median}run is \
                             {:.0}% of it)",
                            self.median_gb_per_s / rate.max(1e-12) * 100.0
                        )
                    })
                    .unwrap_or_default();
                format!("bound by {MAPPING} of every page{copy}")
            }
            _ => "no limit that applies could be measured here".to_string(),
        };
        format!("  {how}: {verdict}\n")
    }
}

#[cfg(test)]
mod tests {
    use super::super::run::sample_run as run;
    use super::*;

    fn limits(rates: &[(&'static str, Option<f64>)]) -> BTreeMap<&'static str, Limit> {
        rates
            .iter()
            .map(|&(name, rate)| {
                let limit = Limit {
                    gb_per_s: rate,
                    what: String::new(),
                    bytes: 0,
                };
                (name, limit)
            })
            .collect()
    }

    fn report(
        runs: &[RunReport],
        limits: &BTreeMap<&'static str, Limit>,
        measured: &[&'static str],
    ) -> ModeReport {
        let refs: Vec<&RunReport> = runs.iter().collect();
        ModeReport::new(&refs, None, limits, measured)
    }

    #[test]
    fn the_lowest_applicable_limit_binds_from_80_percent() {
        let l = limits(&[
            ("page_cache", Some(2.0)),
            ("host_to_device", Some(4.0)),
            ("storage_direct", None),
        ]);
        let runs = [
            run(1, 1.0, ReadFrom::PageCache, "read"),
            run(2, 1.8, ReadFrom::PageCache, "read"),
            run(3, 1.7, ReadFrom::PageCache, "read"),
        ];
        let m = report(&runs, &l, &["page_cache", "host_to_device"]);
        assert_eq!(
            (m.best_run, m.limit, m.bound_by),
            (2, Some("page_cache"), "page_cache")
        );
        // The median run is judged.
        assert!((m.fraction_of_limit.unwrap() - 0.85).abs() < 1e-9);
        assert!(m
            .sentence("read", &l)
            .contains("copied out of the page cache: median 85% of page_cache"));
        let m = report(&runs[..1], &l, &["host_to_device"]);
        assert_eq!((m.limit, m.bound_by), (Some("host_to_device"), FASTLOAD));
        let m = report(&runs, &l, &["storage_direct"]);
        assert_eq!(
            (m.limit, m.fraction_of_limit, m.bound_by),
            (None, None, UNMEASURED)
        );
    }

    #[test]
    fn the_median_run_is_judged_and_the_spread_kept() {
        // Cold runs that spread: the best is at the storage's rate, the median far below it.
        let l = limits(&[("storage_direct", Some(1.4))]);
        let runs = [
            run(1, 0.6, ReadFrom::Storage, "mmap"),
            run(2, 1.5, ReadFrom::Storage, "mmap"),
            run(3, 0.5, ReadFrom::Storage, "mmap"),
        ];
        let m = report(&runs, &l, &["storage_direct"]);
        assert_eq!((m.best_run, m.runs), (2, 3));
        assert_eq!(
            (m.min_gb_per_s, m.median_gb_per_s, m.best_gb_per_s),
            (0.5, 0.6, 1.5)
        );
        assert_eq!(m.bound_by, FASTLOAD);
        assert!(m
            .sentence("mmap", &l)
            .contains("median 43% of storage_direct"));
        // An even count: the mean of the middle two.
        let m = report(&runs[..2], &l, &["storage_direct"]);
        assert!((m.median_gb_per_s - 1.05).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn far_above_a_limit_is_never_noise() {
        let l = limits(&[("storage_direct", Some(1.0))]);
        // 2.6x the storage: the measurement ran low, and the sentence says so.
        let m = report(
            &[run(1, 2.6, ReadFrom::Storage, "read")],
            &l,
            &["storage_direct"],
        );
        assert_eq!(m.bound_by, ABOVE);
        let text = m.sentence("read", &l);
        assert!(
            text.contains("260% of storage_direct") && text.contains("ran low"),
            "{text}"
        );
        assert!(
            !text.contains("noise)") && !text.contains("bound by"),
            "{text}"
        );
        // A little above: at the limit, within noise.
        let m = report(
            &[run(1, 1.1, ReadFrom::Storage, "mmap")],
            &l,
            &["storage_direct"],
        );
        assert_eq!(m.bound_by, "storage_direct");
        let text = m.sentence("mmap", &l);
        assert!(
            text.contains("pages read from storage on first touch"),
            "{text}"
        );
        assert!(
            text.contains("bound by storage_direct (at the limit, within noise)"),
            "{text}"
        );
    }

    #[test]
    fn a_mapped_run_from_memory_is_bound_by_mapping_not_the_copy_rate() {
        let l = limits(&[("page_cache", Some(3.0))]);
        let m = report(
            &[run(1, 7.9, ReadFrom::PageCache, "mmap")],
            &l,
            &["page_cache"],
        );
        assert_eq!((m.limit, m.bound_by), (None, MAPPING));
        let text = m.sentence("mmap", &l);
        assert!(text.starts_with("  mapped, nothing copied: bound by mapping and first touch"));
        assert!(
            text.ends_with(
                "every page, not by page_cache (3.000 GB/s, a copy rate; the run is 263% of it)\n"
            ),
            "{text}"
        );
        // Beside the mapping touched page by page, measured: that limit judges it.
        let l = limits(&[("page_cache", Some(3.0)), ("mapped_touch", Some(9.0))]);
        let m = report(
            &[run(1, 7.9, ReadFrom::PageCache, "mmap")],
            &l,
            &["page_cache", "mapped_touch"],
        );
        assert_eq!(
            (m.limit, m.bound_by),
            (Some("mapped_touch"), "mapped_touch")
        );
        let text = m.sentence("mmap", &l);
        assert_eq!(
            text,
            "  mapped, nothing copied: 88% of mapped_touch (9.000 GB/s): bound by mapped_touch\n"
        );
        // mapped_touch never judges a run that copies.
        let m = report(
            &[run(1, 2.9, ReadFrom::PageCache, "read")],
            &l,
            &["page_cache", "mapped_touch"],
        );
        assert_eq!(m.limit, Some("page_cache"));
        // The same rate read into buffers would be far above the copy rate.
        let m = report(
            &[run(1, 7.9, ReadFrom::PageCache, "read")],
            &l,
            &["page_cache"],
        );
        assert_eq!(m.bound_by, ABOVE);
        // A mapped local copy (--cache) is not bounded by the network.
        let l = limits(&[("ranged_get", Some(0.5))]);
        let m = report(
            &[run(2, 3.0, ReadFrom::LocalCopy, "mmap")],
            &l,
            &["ranged_get"],
        );
        assert_eq!((m.limit, m.bound_by), (None, MAPPING));
    }

    #[test]
    fn runs_of_several_sources_get_a_report_each() {
        // --cache: the first run streams and fills, the others map the copy.
        let l = limits(&[("ranged_get", Some(0.5))]);
        let runs = [
            run(1, 0.45, ReadFrom::Network, "read"),
            run(2, 3.0, ReadFrom::LocalCopy, "mmap"),
            run(3, 3.2, ReadFrom::LocalCopy, "mmap"),
        ];
        let m = report(&runs, &l, &["ranged_get"]);
        assert_eq!(
            (m.best_run, m.read_from, m.bound_by),
            (3, ReadFrom::LocalCopy, MAPPING)
        );
        let parts: Vec<_> = m
            .by_source
            .iter()
            .map(|r| (r.best_run, r.read_from, r.bound_by))
            .collect();
        assert_eq!(
            parts,
            [
                (1, ReadFrom::Network, "ranged_get"),
                (3, ReadFrom::LocalCopy, MAPPING)
            ]
        );
        assert!(report(&runs[1..], &l, &["ranged_get"]).by_source.is_empty());
    }

    #[test]
    fn where_a_run_read_from() {
        // Every shard a local file named on the command line: evicted or not.
        assert_eq!(ReadFrom::of_run(2, 2, 2, true), ReadFrom::Storage);
        assert_eq!(ReadFrom::of_run(2, 2, 2, false), ReadFrom::PageCache);
        // Objects: the network, unless every one was read from a local copy.
        assert_eq!(ReadFrom::of_run(1, 0, 0, false), ReadFrom::Network);
        assert_eq!(ReadFrom::of_run(1, 1, 0, true), ReadFrom::LocalCopy);
        assert_eq!(ReadFrom::of_run(3, 2, 1, false), ReadFrom::Network);
        let labels: Vec<_> = [
            ReadFrom::Storage,
            ReadFrom::PageCache,
            ReadFrom::Network,
            ReadFrom::LocalCopy,
        ]
        .iter()
        .map(|r| r.label())
        .collect();
        assert_eq!(labels, READ_FROM_LABELS);
        assert_eq!(
            serde_json::to_string(&ReadFrom::LocalCopy).unwrap(),
            "\"local_copy\""
        );
    }
}
