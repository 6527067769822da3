//! `fastload bench`'s peers: the peer loaders that are installed (safetensors,
//! runai-model-streamer, fastsafetensors, tensorizer) on the same files, each load in a fresh
//! Python process (the drivers are `fastload._peers`, shipped in the package), cold and warm as
//! the runs; fastload's ratio to the best peer, and why the others did not run.
//!
//! By default the first installed peer is shown beside fastload's own runs, as one more row;
//! `--compare` (all peers, or those named) also loads fastload through the same driver, so that
//! every row is measured the same way; `--compare none` compares nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::str::FromStr;

use serde::Serialize;
use serde_json::Value;

use super::{plural, print_stdout, CliResult};

/// The peers, in the order they are tried, run and printed; named as their packages are.
pub(super) const PEERS: [&str; 4] = [
    "safetensors",
    "runai-model-streamer",
    "fastsafetensors",
    "tensorizer",
];

/// Which peers to load the same files with (`--compare[=PEERS]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Peers {
    /// No `--compare`: the first installed peer, beside fastload's own runs.
    Default,
    /// `--compare none`.
    None,
    /// `--compare` or `--compare all` (every peer), or the peers named; fastload is loaded
    /// through the same driver beside them.
    Chosen(Vec<&'static str>),
}

impl FromStr for Peers {
    type Err = String;

    fn from_str(s: &str) -> Result<Peers, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "all" => return Ok(Peers::Chosen(PEERS.to_vec())),
            "none" => return Ok(Peers::None),
            _ => {}
        }
        let mut chosen = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some(&peer) = PEERS.iter().find(|p| p.eq_ignore_ascii_case(name)) else {
                return Err(format!(
                    "{name:?} is not a peer (use all, none, or a comma-separated list of {})",
                    PEERS.join(", ")
                ));
            };
            if !chosen.contains(&peer) {
                chosen.push(peer);
            }
        }
        if chosen.is_empty() {
            return Err("no peer named (use all, none, or a comma-separated list)".into());
        }
        Ok(Peers::Chosen(chosen))
    }
}

/// `--compare VALUE` written with a space: clap reads an optional value only after `=`
/// (`--compare=all`), so that `fastload bench --compare model/` keeps `model/` a URI. A word after
/// a bare `--compare` that names peers (`all`, `none`, `safetensors,tensorizer`) is its value.
pub(super) fn attach_value(args: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        if arg == "--" {
            out.push(arg);
            out.extend(args);
            break;
        }
        if arg == "--compare" {
            if let Some(value) = args.next_if(|v| v.parse::<Peers>().is_ok()) {
                out.push(format!("--compare={value}"));
                continue;
            }
        }
        out.push(arg);
    }
    out
}

/// The Python to run the drivers with: `--python`, else `$FASTLOAD_PYTHON`, else the
/// interpreter this CLI runs in (the wheel's `fastload` script), else `python3`.
pub(super) fn python(arg: Option<&str>, host: Option<&str>) -> String {
    arg.map(str::to_string)
        .or_else(|| {
            std::env::var("FASTLOAD_PYTHON")
                .ok()
                .filter(|p| !p.is_empty())
        })
        .or_else(|| host.filter(|p| !p.is_empty()).map(str::to_string))
        .unwrap_or_else(|| "python3".into())
}

/// One loader's timed loads in one cache mode.
#[derive(Serialize, Default, Clone)]
pub(super) struct PeerRuns {
    pub seconds: Vec<f64>,
    pub bytes: u64,
    pub best_gb_per_s: f64,
    /// The modules its timed sections imported (a driver row's; none for fastload's own runs).
    pub imported_in_clock: BTreeSet<String>,
}

/// A module one row's timed section imported that other rows imported before their clocks: that
/// row paid for an import the others did not (the comparison was not fair).
#[derive(Serialize, Clone, Debug, PartialEq)]
pub(super) struct UnfairImport {
    pub loader: &'static str,
    pub module: String,
    pub preloaded_by: Vec<&'static str>,
}

#[derive(Serialize)]
pub(super) struct NotRun {
    pub loader: &'static str,
    pub reason: String,
}

#[derive(Serialize)]
pub(super) struct Compare {
    pub python: String,
    /// "default" (the first installed peer), or the peers asked for, comma-separated.
    pub peers: String,
    /// Where fastload's rates come from: "runs" (the bench's own runs, the default) or "driver"
    /// (loaded by the same driver as the peers, with `--compare`).
    pub fastload_from: &'static str,
    /// loader → mode ("cold", "warm") → runs.
    pub loaders: BTreeMap<&'static str, BTreeMap<&'static str, PeerRuns>>,
    pub not_run: Vec<NotRun>,
    /// mode → fastload's best GB/s over the best peer's (null without both).
    pub ratio_to_best_peer: BTreeMap<&'static str, Option<f64>>,
    /// Imports a row's clock paid for that another row made before its clock (empty: fair).
    pub unfair_imports: Vec<UnfairImport>,
    /// loader → the modules its processes had imported when their clocks started.
    #[serde(skip)]
    pub preloaded: BTreeMap<&'static str, BTreeSet<String>>,
}

/// What one driver process printed: its last line, parsed; or why it could not run.
fn driver(python: &str, arg: &str) -> Result<Value, String> {
    let out = Command::new(python)
        .args(["-m", "fastload._peers", arg])
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    match last.and_then(|l| serde_json::from_str::<Value>(l).ok()) {
        Some(v) if out.status.success() => Ok(v),
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no output");
            Err(format!("{python} -m fastload._peers: {why}"))
        }
    }
}

/// Hooks the bench provides: evict the files (true when it took effect), or read them once.
pub(super) struct Hooks<'a> {
    pub evict: &'a dyn Fn() -> bool,
    pub warm: &'a dyn Fn(),
}

pub(super) struct Job<'a> {
    pub python: String,
    pub peers: &'a Peers,
    /// With [`Peers::Default`]: fastload's own runs, mode → runs, shown beside the peer.
    pub runs: BTreeMap<&'static str, PeerRuns>,
    pub uris: &'a [String],
    /// Local files (every peer but fastload reads files); fewer than shards: remote.
    pub files: &'a [PathBuf],
    pub remote: bool,
    /// The files are encrypted (read with a keyset): peers would read ciphertext.
    pub encrypted: bool,
    /// fastload's options as given on the command line (the rest come from FASTLOAD_*).
    pub options: serde_json::Map<String, Value>,
    pub modes: &'a [&'static str],
    pub repeat: u32,
    pub print: bool,
}

/// The loaders to run: the peers wanted that are installed and applicable (and fastload, loaded
/// by the driver, unless it is the default comparison); the others go to `not_run`.
fn runnable(job: &Job<'_>, not_run: &mut Vec<NotRun>) -> Vec<&'static str> {
    let wanted: Vec<&'static str> = match job.peers {
        Peers::None => return Vec::new(),
        Peers::Default => PEERS.to_vec(),
        Peers::Chosen(peers) => std::iter::once("fastload")
            .chain(peers.iter().copied())
            .collect(),
    };
    let found = match driver(&job.python, "--probe") {
        Ok(found) => found,
        Err(why) => {
            for loader in wanted {
                not_run.push(NotRun {
                    loader,
                    reason: format!("failed: {why}"),
                });
            }
            return Vec::new();
        }
    };
    let mut runnable = Vec::new();
    for loader in wanted {
        let missing = found.get(loader).and_then(Value::as_str);
        let reason = if let Some(why) = missing {
            why.to_string()
        } else if job.remote && loader != "fastload" {
            "not applicable to this URI (the comparison reads peers from local files only)".into()
        } else if job.encrypted && loader != "fastload" {
            "not applicable: the files are encrypted, and peers read plain safetensors files only"
                .into()
        } else if *job.peers == Peers::Default && !runnable.is_empty() {
            continue; // one peer by default: the first installed
        } else {
            runnable.push(loader);
            continue;
        };
        not_run.push(NotRun { loader, reason });
    }
    let installed = |n: &NotRun| !n.reason.starts_with("not installed");
    if *job.peers == Peers::Default && (!runnable.is_empty() || not_run.iter().any(installed)) {
        // The default row names no peer that is simply not installed, when one is.
        not_run.retain(installed);
    }
    runnable
}

/// One driver load: its seconds and bytes, the modules its process had imported when the clock
/// started and those its timed section imported.
struct Sample {
    seconds: f64,
    bytes: u64,
    before: BTreeSet<String>,
    in_clock: BTreeSet<String>,
}

/// The names in the driver's list `key` (none when it printed none: a driver of an older fastload).
fn modules(v: &Value, key: &str) -> BTreeSet<String> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// One timed load of `loader` in a fresh driver process, or why it did not run.
fn load_once(job: &Job<'_>, loader: &'static str, files: &[String]) -> Result<Sample, NotRun> {
    let arg = serde_json::json!({
        "loader": loader,
        "workload": "load",
        "uri": if loader == "fastload" { job.uris.to_vec() } else { files.to_vec() },
        "files": files,
        "options": job.options,
    })
    .to_string();
    // A peer's own message may quote the URI with its credentials.
    let failed = |reason: String| NotRun {
        loader,
        reason: crate::error::scrub(&reason),
    };
    let v = driver(&job.python, &arg).map_err(|why| failed(format!("failed: {why}")))?;
    if let Some(why) = v.get("skipped").and_then(Value::as_str) {
        // Found but not importable: a broken install.
        let kind = if why.starts_with("import ") {
            "failed"
        } else {
            "not applicable"
        };
        return Err(failed(format!("{kind}: {why}")));
    }
    if let Some(why) = v.get("error").and_then(Value::as_str) {
        return Err(failed(format!("failed: {why}")));
    }
    let s = v.get("seconds").and_then(Value::as_f64);
    let b = v.get("bytes").and_then(Value::as_u64);
    let (seconds, bytes) = s
        .zip(b)
        .ok_or_else(|| failed(format!("failed: printed {v}")))?;
    Ok(Sample {
        seconds,
        bytes,
        before: modules(&v, "modules_before_clock"),
        in_clock: modules(&v, "modules_in_clock"),
    })
}

pub(super) fn run(job: &Job<'_>, hooks: &Hooks<'_>) -> CliResult<Compare> {
    let default = *job.peers == Peers::Default;
    let mut report = Compare {
        python: job.python.clone(),
        peers: match job.peers {
            Peers::Chosen(peers) => peers.join(","),
            _ => "default".into(),
        },
        fastload_from: if default { "runs" } else { "driver" },
        loaders: BTreeMap::new(),
        not_run: Vec::new(),
        ratio_to_best_peer: BTreeMap::new(),
        unfair_imports: Vec::new(),
        preloaded: BTreeMap::new(),
    };
    let mut runnable = runnable(job, &mut report.not_run);
    if default {
        let mine = job.runs.iter().map(|(&mode, runs)| (mode, runs.clone()));
        report.loaders.insert("fastload", mine.collect());
    }
    let files: Vec<String> = job.files.iter().map(|f| f.display().to_string()).collect();
    let total = job.modes.len() * job.repeat as usize * runnable.len();
    let mut started = 0;
    for &mode in job.modes {
        if mode == "warm" {
            (hooks.warm)();
        }
        for _ in 0..job.repeat {
            for loader in runnable.clone() {
                if mode == "cold" {
                    (hooks.evict)();
                }
                started += 1;
                // A fresh Python per load takes seconds (torch's import): say what runs.
                eprintln!("fastload: compare: load {started}/{total}: {loader}, {mode}");
                match load_once(job, loader, &files) {
                    Ok(sample) => report.record(loader, mode, sample, job.print)?,
                    Err(not_run) => {
                        runnable.retain(|&l| l != loader);
                        report.loaders.remove(loader);
                        report.not_run.push(not_run);
                    }
                }
            }
        }
        report.ratio(mode);
    }
    report.unfair_imports = unfair_imports(&report.loaders, &report.preloaded);
    Ok(report)
}

/// Every module a row's timed sections imported that another row's processes had imported
/// before their clocks.
fn unfair_imports(
    loaders: &BTreeMap<&'static str, BTreeMap<&'static str, PeerRuns>>,
    preloaded: &BTreeMap<&'static str, BTreeSet<String>>,
) -> Vec<UnfairImport> {
    let mut out = Vec::new();
    for (&loader, modes) in loaders {
        let imported: BTreeSet<&String> =
            modes.values().flat_map(|r| &r.imported_in_clock).collect();
        for module in imported {
            let preloaded_by: Vec<&'static str> = preloaded
                .iter()
                .filter(|(&other, before)| other != loader && before.contains(module))
                .map(|(&other, _)| other)
                .collect();
            if !preloaded_by.is_empty() {
                out.push(UnfairImport {
                    loader,
                    module: module.clone(),
                    preloaded_by,
                });
            }
        }
    }
    out
}

impl Compare {
    fn record(
        &mut self,
        loader: &'static str,
        mode: &'static str,
        sample: Sample,
        print: bool,
    ) -> CliResult {
        let runs = self
            .loaders
            .entry(loader)
            .or_default()
            .entry(mode)
            .or_default();
        let Sample {
            seconds,
            bytes,
            before,
            in_clock,
        } = sample;
        runs.seconds.push(seconds);
        runs.bytes = bytes;
        let rate = bytes as f64 / seconds.max(1e-9) / 1e9;
        runs.best_gb_per_s = runs.best_gb_per_s.max(rate);
        runs.imported_in_clock.extend(in_clock);
        self.preloaded.entry(loader).or_default().extend(before);
        if print {
            print_stdout(&format!(
                "  {mode:<5} {loader:<16} {seconds:>9.4} s  {rate:>8.3} GB/s\n"
            ))?;
        }
        Ok(())
    }

    /// fastload's best rate in `mode` over the best peer's.
    fn ratio(&mut self, mode: &'static str) {
        let best = |peers: bool| {
            self.loaders
                .iter()
                .filter(|(name, _)| (**name != "fastload") == peers)
                .filter_map(|(_, m)| m.get(mode).map(|r| r.best_gb_per_s))
                .reduce(f64::max)
        };
        let ratio = best(false).zip(best(true)).map(|(f, p)| f / p.max(1e-12));
        self.ratio_to_best_peer.insert(mode, ratio);
    }

    /// The side-by-side table; the default comparison's is the peer as one more row beside
    /// fastload's runs, or one line saying why there is none.
    pub fn table(&self, modes: &[&'static str]) -> String {
        let peers: Vec<&str> = self
            .loaders
            .keys()
            .copied()
            .filter(|&n| n != "fastload")
            .collect();
        let default = self.fastload_from == "runs";
        let mut out = String::from("\n");
        if default {
            let [peer] = peers[..] else {
                return self.no_peer_line();
            };
            out.push_str(&format!(
                "beside {peer}, each of its loads in a fresh process of {} (--compare: every \
                 peer; --compare none: off):\n",
                self.python
            ));
        } else {
            out.push_str(&format!(
                "compare: each load in a fresh process of {} (load every tensor, then read one \
                 byte of every 4 KiB page); best GB/s\n",
                self.python
            ));
        }
        let ratio_label = match peers[..] {
            [peer] if default => format!("fastload / {peer}"),
            _ => "fastload / best peer".to_string(),
        };
        let width = 22.max(ratio_label.len() + 2);
        out.push_str(&format!("{:<width$}", "loader"));
        for mode in modes {
            out.push_str(&format!("{:>11}", format!("{mode} GB/s")));
        }
        out.push('\n');
        for (&name, runs) in &self.loaders {
            let label = if default && name == "fastload" {
                "fastload (runs above)"
            } else {
                name
            };
            out.push_str(&format!("{label:<width$}"));
            for mode in modes {
                match runs.get(mode) {
                    Some(r) => out.push_str(&format!("{:>11.3}", r.best_gb_per_s)),
                    None => out.push_str(&format!("{:>11}", "-")),
                }
            }
            out.push('\n');
        }
        out.push_str(&format!("{ratio_label:<width$}"));
        for mode in modes {
            match self.ratio_to_best_peer.get(mode).copied().flatten() {
                Some(r) => out.push_str(&format!("{:>11}", format!("{r:.2}x"))),
                None => out.push_str(&format!("{:>11}", "-")),
            }
        }
        out.push('\n');
        for n in &self.not_run {
            out.push_str(&format!("not run: {}: {}\n", n.loader, n.reason));
        }
        out.push_str(&self.unfair_lines());
        out
    }

    /// One line per row whose clock paid for imports other rows made before theirs (none when
    /// the comparison was fair).
    fn unfair_lines(&self) -> String {
        let mut out = String::new();
        for &loader in self.loaders.keys() {
            let mine: Vec<&UnfairImport> = self
                .unfair_imports
                .iter()
                .filter(|u| u.loader == loader)
                .collect();
            let Some(first) = mine.first() else { continue };
            let more = match mine.len() - 1 {
                0 => String::new(),
                n => format!(" and {}", plural(n, "more module")),
            };
            out.push_str(&format!(
                "not fair: {loader}'s timed loads imported {}{more}, which {} imported before \
                 the clock\n",
                first.module,
                first.preloaded_by.join(", ")
            ));
        }
        out
    }

    /// What to install into the Python of the peers for the default row to appear.
    fn install_hint(&self, torch_missing: bool) -> String {
        let py = &self.python;
        let packages = if torch_missing {
            "torch safetensors"
        } else {
            "safetensors"
        };
        let mut out = format!(
            "  to see safetensors beside fastload, install it into that Python and run again:\n    \
             {py} -m pip install {packages}\n"
        );
        if torch_missing {
            out.push_str(&format!(
                "  (or torch's CPU build: {py} -m pip install torch --index-url \
                 https://download.pytorch.org/whl/cpu, then {py} -m pip install safetensors)\n"
            ));
        }
        out
    }

    /// The default comparison without a peer: why, on one line (and what to install, when
    /// nothing is) when every peer has the same reason.
    fn no_peer_line(&self) -> String {
        let hint = "--python PATH picks another Python, --compare none drops this line";
        let reasons: Vec<&str> = self.not_run.iter().map(|n| n.reason.as_str()).collect();
        let same = reasons.iter().all(|r| *r == reasons[0]);
        let torch_missing = same && reasons.first().is_some_and(|r| r.contains("torch is not"));
        let none_installed = reasons.iter().all(|r| r.starts_with("not installed"));
        // One reason for every peer (the Python has no torch, or cannot run the drivers, or the
        // files are encrypted), or none of the peers installed.
        let shared = reasons.first().filter(|_| same).and_then(|first| {
            first
                .strip_prefix("not installed: ")
                .or_else(|| first.strip_prefix("failed: "))
                .or_else(|| first.strip_prefix("not applicable: "))
        });
        let why = match shared {
            Some(why) => Some(why.to_string()),
            None if reasons.iter().all(|r| r.starts_with("not installed")) => Some(format!(
                "none of {} is installed in {}",
                PEERS.join(", "),
                self.python
            )),
            None => None,
        };
        if let Some(why) = why {
            let install = if none_installed && !reasons.is_empty() {
                self.install_hint(torch_missing)
            } else {
                String::new()
            };
            return format!("\nno peer beside it: {why} ({hint})\n{install}");
        }
        let mut out = format!("\nno peer beside it ({hint}):\n");
        for n in &self.not_run {
            out.push_str(&format!("not run: {}: {}\n", n.loader, n.reason));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_as_all_none_or_a_list() {
        assert_eq!("all".parse::<Peers>(), Ok(Peers::Chosen(PEERS.to_vec())));
        assert_eq!("None".parse::<Peers>(), Ok(Peers::None));
        assert_eq!(
            "tensorizer, safetensors,tensorizer".parse::<Peers>(),
            Ok(Peers::Chosen(vec!["tensorizer", "safetensors"]))
        );
        let err = "runai".parse::<Peers>().unwrap_err();
        assert!(err.contains("\"runai\" is not a peer") && err.contains("runai-model-streamer"));
        assert!("model/".parse::<Peers>().is_err() && ",".parse::<Peers>().is_err());
    }

    #[test]
    fn a_word_after_compare_is_its_value_only_when_it_names_peers() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cases: [(&[&str], &[&str]); 5] = [
            (&["bench", "--compare", "all"], &["bench", "--compare=all"]),
            (
                &["bench", "--compare", "safetensors,tensorizer", "m/"],
                &["bench", "--compare=safetensors,tensorizer", "m/"],
            ),
            // Today's form: a URI after --compare stays a URI (all peers).
            (&["bench", "--compare", "m/"], &["bench", "--compare", "m/"]),
            (&["bench", "--compare"], &["bench", "--compare"]),
            (
                &["bench", "--", "--compare", "none"],
                &["bench", "--", "--compare", "none"],
            ),
        ];
        for (given, want) in cases {
            assert_eq!(attach_value(args(given)), args(want), "{given:?}");
        }
    }

    #[test]
    fn the_python_is_the_flag_then_the_variable_then_the_host_interpreter() {
        // FASTLOAD_PYTHON is read from the environment: only the cases it cannot change here.
        assert_eq!(python(Some("/p/python"), Some("/host/python")), "/p/python");
        if std::env::var_os("FASTLOAD_PYTHON").is_none() {
            assert_eq!(python(None, Some("/host/python")), "/host/python");
            assert_eq!(python(None, None), "python3");
        }
    }

    fn compare(loaders: &[(&'static str, f64)], not_run: &[(&'static str, &str)]) -> Compare {
        let runs = |rate: f64| {
            let mut modes = BTreeMap::new();
            modes.insert(
                "warm",
                PeerRuns {
                    seconds: vec![1.0],
                    bytes: 1,
                    best_gb_per_s: rate,
                    imported_in_clock: BTreeSet::new(),
                },
            );
            modes
        };
        Compare {
            python: "/v/bin/python".into(),
            peers: "default".into(),
            fastload_from: "runs",
            loaders: loaders.iter().map(|&(n, r)| (n, runs(r))).collect(),
            not_run: not_run
                .iter()
                .map(|&(loader, reason)| NotRun {
                    loader,
                    reason: reason.into(),
                })
                .collect(),
            ratio_to_best_peer: [("warm", Some(2.0))].into(),
            unfair_imports: Vec::new(),
            preloaded: BTreeMap::new(),
        }
    }

    #[test]
    fn the_default_shows_one_peer_as_one_more_row() {
        let c = compare(&[("fastload", 4.0), ("safetensors", 2.0)], &[]);
        let table = c.table(&["warm"]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(
            lines[1].starts_with(
                "beside safetensors, each of its loads in a fresh process of /v/bin/python"
            ),
            "{table}"
        );
        assert!(
            lines[1].ends_with("(--compare: every peer; --compare none: off):"),
            "{table}"
        );
        assert_eq!(
            lines[3].split_whitespace().collect::<Vec<_>>(),
            ["fastload", "(runs", "above)", "4.000"]
        );
        assert_eq!(
            lines[4].split_whitespace().collect::<Vec<_>>(),
            ["safetensors", "2.000"]
        );
        assert!(lines[5].starts_with("fastload / safetensors") && lines[5].ends_with("2.00x"));
        assert_eq!(lines.len(), 6, "{table}");

        let why = "not installed (no module 'safetensors.torch' in /v/bin/python)";
        let c = compare(
            &[("fastload", 4.0)],
            &[("safetensors", why), ("tensorizer", why)],
        );
        let line = c.table(&["warm"]);
        assert_eq!(
            line,
            "\nno peer beside it: none of safetensors, runai-model-streamer, fastsafetensors, \
             tensorizer is installed in /v/bin/python (--python PATH picks another Python, \
             --compare none drops this line)\n  to see safetensors beside fastload, install it \
             into that Python and run again:\n    /v/bin/python -m pip install safetensors\n"
        );
        let why = "not installed: torch is not installed in /v/bin/python";
        let c = compare(
            &[("fastload", 4.0)],
            &[("safetensors", why), ("tensorizer", why)],
        );
        let text = c.table(&["warm"]);
        assert!(
            text.starts_with(
                "\nno peer beside it: torch is not installed in /v/bin/python (--python"
            ),
            "{text}"
        );
        // What to run for the row to appear: torch and safetensors, or torch's CPU build.
        assert!(
            text.contains("\n    /v/bin/python -m pip install torch safetensors\n")
                && text.contains(
                    "/v/bin/python -m pip install torch --index-url \
                     https://download.pytorch.org/whl/cpu, then /v/bin/python -m pip install \
                     safetensors)"
                ),
            "{text}"
        );
        // A Python that cannot run the drivers: one line too.
        let why =
            "failed: python3 -m fastload._peers: ModuleNotFoundError: No module named 'fastload'";
        let c = compare(
            &[("fastload", 4.0)],
            &[("safetensors", why), ("tensorizer", why)],
        );
        let text = c.table(&["warm"]);
        assert!(text.starts_with(
            "\nno peer beside it: python3 -m fastload._peers: ModuleNotFoundError: No module named \
             'fastload' (--python"
        ));
        assert!(!text.contains("pip install"), "{text}");
        // Encrypted files: every installed peer would read ciphertext.
        let why = "not applicable: the files are encrypted, and peers read plain safetensors \
                   files only";
        let c = compare(&[("fastload", 4.0)], &[("safetensors", why)]);
        assert_eq!(
            c.table(&["warm"]),
            "\nno peer beside it: the files are encrypted, and peers read plain safetensors files \
             only (--python PATH picks another Python, --compare none drops this line)\n"
        );
    }

    #[test]
    fn a_timed_import_another_row_made_before_its_clock_is_unfair() {
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        let mut c = compare(&[("fastload", 4.0), ("safetensors", 2.0)], &[]);
        c.fastload_from = "driver";
        let runs = |m: &mut BTreeMap<&'static str, PeerRuns>, names: &[&str]| {
            m.get_mut("warm").unwrap().imported_in_clock = set(names);
        };
        runs(
            c.loaders.get_mut("fastload").unwrap(),
            &["torch", "torch.nn", "fastload._torch"],
        );
        runs(c.loaders.get_mut("safetensors").unwrap(), &["numpy.random"]);
        c.preloaded
            .insert("fastload", set(&["fastload", "fastload._torch"]));
        c.preloaded
            .insert("safetensors", set(&["safetensors", "torch", "torch.nn"]));
        let unfair = unfair_imports(&c.loaders, &c.preloaded);
        let found: Vec<(&str, &str, Vec<&str>)> = unfair
            .iter()
            .map(|u| (u.loader, u.module.as_str(), u.preloaded_by.clone()))
            .collect();
        // fastload's own glue, imported in its clock, is preloaded by no *other* row.
        assert_eq!(
            found,
            [
                ("fastload", "torch", vec!["safetensors"]),
                ("fastload", "torch.nn", vec!["safetensors"])
            ]
        );
        c.unfair_imports = unfair;
        let text = c.table(&["warm"]);
        assert!(
            text.ends_with(
                "not fair: fastload's timed loads imported torch and 1 more module, which \
                 safetensors imported before the clock\n"
            ),
            "{text}"
        );
        c.unfair_imports.clear();
        assert!(!c.table(&["warm"]).contains("not fair"));
    }
}
