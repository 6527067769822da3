//! `fastload bench --compare`: the peer loaders that are installed (safetensors,
//! runai-model-streamer, fastsafetensors, tensorizer) and fastload itself, on the same files,
//! each load in a fresh Python process (the drivers are `fastload._peers`, shipped in the
//! package), cold and warm; fastload's ratio to the best peer, and why the others did not run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde::Serialize;
use serde_json::Value;

use super::{print_stdout, CliResult};

/// In the order they are run and printed; fastload first.
const LOADERS: [&str; 5] = [
    "fastload",
    "safetensors",
    "runai",
    "fastsafetensors",
    "tensorizer",
];

/// The Python to run the drivers with: `--python`, else `$FASTLOAD_PYTHON` (the wheel's
/// `fastload` script sets it to its own interpreter), else `python3`.
pub(super) fn python(arg: Option<&str>) -> String {
    arg.map(str::to_string)
        .or_else(|| {
            std::env::var("FASTLOAD_PYTHON")
                .ok()
                .filter(|p| !p.is_empty())
        })
        .unwrap_or_else(|| "python3".into())
}

/// One loader's timed loads in one cache mode.
#[derive(Serialize, Default)]
pub(super) struct PeerRuns {
    pub seconds: Vec<f64>,
    pub bytes: u64,
    pub best_gb_per_s: f64,
}

#[derive(Serialize)]
pub(super) struct NotRun {
    pub loader: &'static str,
    pub reason: String,
}

#[derive(Serialize)]
pub(super) struct Compare {
    pub python: String,
    /// loader → mode ("cold", "warm") → runs.
    pub loaders: BTreeMap<&'static str, BTreeMap<&'static str, PeerRuns>>,
    pub not_run: Vec<NotRun>,
    /// mode → fastload's best GB/s over the best peer's (null without both).
    pub ratio_to_best_peer: BTreeMap<&'static str, Option<f64>>,
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
    pub uris: &'a [String],
    /// Local files (every peer but fastload reads files); fewer than shards: remote.
    pub files: &'a [PathBuf],
    pub remote: bool,
    /// fastload's options as given on the command line (the rest come from FASTLOAD_*).
    pub options: serde_json::Map<String, Value>,
    pub modes: &'a [&'static str],
    pub repeat: u32,
    pub print: bool,
}

pub(super) fn run(job: &Job<'_>, hooks: &Hooks<'_>) -> CliResult<Compare> {
    let mut report = Compare {
        python: job.python.clone(),
        loaders: BTreeMap::new(),
        not_run: Vec::new(),
        ratio_to_best_peer: BTreeMap::new(),
    };
    let mut runnable: Vec<&'static str> = Vec::new();
    match driver(&job.python, "--probe") {
        Err(why) => {
            for loader in LOADERS {
                report.not_run.push(NotRun {
                    loader,
                    reason: format!("failed: {why}"),
                });
            }
        }
        Ok(found) => {
            for loader in LOADERS {
                let missing = found.get(loader).and_then(Value::as_str);
                if let Some(why) = missing {
                    report.not_run.push(NotRun {
                        loader,
                        reason: why.to_string(),
                    });
                } else if job.remote && loader != "fastload" {
                    report.not_run.push(NotRun {
                        loader,
                        reason: "not applicable to this URI (the comparison reads peers from \
                                 local files only)"
                            .into(),
                    });
                } else {
                    runnable.push(loader);
                }
            }
        }
    }
    let files: Vec<String> = job.files.iter().map(|f| f.display().to_string()).collect();
    for &mode in job.modes {
        if mode == "warm" {
            (hooks.warm)();
        }
        for _ in 0..job.repeat {
            for loader in runnable.clone() {
                if mode == "cold" {
                    (hooks.evict)();
                }
                let arg = serde_json::json!({
                    "loader": loader,
                    "workload": "load",
                    "uri": if loader == "fastload" { job.uris.to_vec() } else { files.clone() },
                    "files": files,
                    "options": job.options,
                })
                .to_string();
                // A peer's own message may quote the URI with its credentials.
                let failed = |reason: String| NotRun {
                    loader,
                    reason: crate::error::scrub(&reason),
                };
                let result = match driver(&job.python, &arg) {
                    Err(why) => Err(failed(format!("failed: {why}"))),
                    Ok(v) => {
                        if let Some(why) = v.get("skipped").and_then(Value::as_str) {
                            // Found but not importable: a broken install.
                            let kind = if why.starts_with("import ") {
                                "failed"
                            } else {
                                "not applicable"
                            };
                            Err(failed(format!("{kind}: {why}")))
                        } else if let Some(why) = v.get("error").and_then(Value::as_str) {
                            Err(failed(format!("failed: {why}")))
                        } else {
                            let s = v.get("seconds").and_then(Value::as_f64);
                            let b = v.get("bytes").and_then(Value::as_u64);
                            s.zip(b)
                                .ok_or_else(|| failed(format!("failed: printed {v}")))
                        }
                    }
                };
                match result {
                    Ok((seconds, bytes)) => {
                        let runs = report
                            .loaders
                            .entry(loader)
                            .or_default()
                            .entry(mode)
                            .or_default();
                        runs.seconds.push(seconds);
                        runs.bytes = bytes;
                        let rate = bytes as f64 / seconds.max(1e-9) / 1e9;
                        runs.best_gb_per_s = runs.best_gb_per_s.max(rate);
                        if job.print {
                            print_stdout(&format!(
                                "  {mode:<5} {loader:<16} {seconds:>9.4} s  {rate:>8.3} GB/s\n"
                            ))?;
                        }
                    }
                    Err(not_run) => {
                        runnable.retain(|&l| l != loader);
                        report.loaders.remove(loader);
                        report.not_run.push(not_run);
                    }
                }
            }
        }
        let best = |peers: bool| {
            report
                .loaders
                .iter()
                .filter(|(name, _)| (**name != "fastload") == peers)
                .filter_map(|(_, m)| m.get(mode).map(|r| r.best_gb_per_s))
                .reduce(f64::max)
        };
        let ratio = best(false).zip(best(true)).map(|(f, p)| f / p.max(1e-12));
        report.ratio_to_best_peer.insert(mode, ratio);
    }
    Ok(report)
}

impl Compare {
    /// The side-by-side table.
    pub fn table(&self, modes: &[&'static str]) -> String {
        let mut out = format!(
            "\ncompare: each load in a fresh process of {} (load every tensor, then read one byte \
             of every 4 KiB page); best GB/s\n{:<22}",
            self.python, "loader"
        );
        for mode in modes {
            out.push_str(&format!("{:>10}", format!("{mode} GB/s")));
        }
        out.push('\n');
        for (name, runs) in &self.loaders {
            out.push_str(&format!("{name:<22}"));
            for mode in modes {
                match runs.get(mode) {
                    Some(r) => out.push_str(&format!("{:>10.3}", r.best_gb_per_s)),
                    None => out.push_str(&format!("{:>10}", "-")),
                }
            }
            out.push('\n');
        }
        out.push_str(&format!("{:<22}", "fastload / best peer"));
        for mode in modes {
            match self.ratio_to_best_peer.get(mode).copied().flatten() {
                Some(r) => out.push_str(&format!("{:>10}", format!("{r:.2}x"))),
                None => out.push_str(&format!("{:>10}", "-")),
            }
        }
        out.push('\n');
        for n in &self.not_run {
            out.push_str(&format!("not run: {}: {}\n", n.loader, n.reason));
        }
        out
    }
}
