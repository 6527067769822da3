//! The `fastload` command line (bench, inspect, copy, serve); shared by the binary and the
//! wheel's script.
//!
//! Parsing never exits the process (the Python console script calls [`run`] in-process): clap's
//! own messages are printed and its exit code returned; every other failure becomes exactly one
//! line `fastload: error: ...` on stderr and exit code 1.

use std::fmt;
use std::io::{self, Write};
use std::str::FromStr;

use clap::{Parser, Subcommand};

mod bench;
mod checkpoint;
mod compare;
pub(crate) mod copy;
mod inspect;
mod limits;
mod page_cache;
mod report;
mod run;
mod verdict;

/// `fastload.inspect` returns what `fastload inspect --json` prints.
#[cfg(feature = "python")]
pub(crate) use inspect::to_json as inspect_json;

/// Runs the CLI with `args` (including the program name) and returns the exit code.
pub fn run(args: Vec<String>) -> i32 {
    run_in(args, None)
}

/// [`run`] inside a Python interpreter (the wheel's `fastload` script): `python` is that
/// interpreter, the one `fastload bench` runs its peers with unless told otherwise.
pub fn run_in(args: Vec<String>, python: Option<String>) -> i32 {
    let cli = match Cli::try_parse_from(compare::attach_value(args)) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version land here too, with exit code 0.
            let _ = e.print();
            return e.exit_code();
        }
    };
    let result = match cli.command {
        Command::Bench(args) => bench::run(args, python.as_deref()),
        Command::Inspect(args) => inspect::run(args),
        Command::Copy(args) => copy::run(args),
        Command::Serve(args) => crate::serve::run(args).map_err(CliError::from),
    };
    match result {
        Ok(()) => 0,
        // The reader went away (`fastload inspect m.safetensors | head`): not an error.
        Err(CliError::Stdout(e)) if e.kind() == io::ErrorKind::BrokenPipe => 0,
        Err(e) => {
            // Scrubbed of known credentials, as every message that leaves fastload, and naming
            // arguments by their flags (`--overwrite`, not Python's `overwrite=True`).
            let text = match &e {
                CliError::Load(e) => e.message_for(crate::options::FrontEnd::Cli),
                e => crate::error::scrub(&e.to_string()),
            };
            let line = text.replace(['\n', '\r'], " ");
            eprintln!("fastload: error: {line}");
            1
        }
    }
}

/// A command-line argument as [`run`] takes it. One that is not UTF-8 can only be a local path
/// (Linux paths are bytes; options and URIs are text): it becomes a `file://` URI, absolute and
/// percent-encoded byte for byte, which every command reads as that path.
pub fn arg_from_os(arg: std::ffi::OsString) -> String {
    arg.into_string().unwrap_or_else(|arg| {
        let path = std::path::absolute(&arg).unwrap_or_else(|_| arg.clone().into());
        url::Url::from_file_path(&path)
            .map(String::from)
            .unwrap_or_else(|()| arg.to_string_lossy().into_owned())
    })
}

const UNITS_HELP: &str = "Sizes take a number of bytes or a unit: 4096, 64KiB, 8MiB, 1GiB, 500MB \
                          (KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024). Throughput \
                          is reported in GB/s (10^9 bytes per second).";

#[derive(Parser)]
#[command(
    name = "fastload",
    bin_name = "fastload",
    version,
    about = "Load safetensors checkpoints fast; benchmark and inspect them.",
    after_help = UNITS_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load checkpoints into memory and report throughput and time to first tensor.
    #[command(after_help = UNITS_HELP)]
    Bench(bench::BenchArgs),
    /// List every tensor (name, dtype, shape, bytes, file), then each file and the totals;
    /// reads headers only (--json adds offsets and metadata).
    Inspect(inspect::InspectArgs),
    /// Copy a file or a whole model folder from any store to any store (the Hub, object stores,
    /// local paths): read once in parallel ranged reads, no local staging, Hub digests checked
    /// while streaming, each file published whole; a rerun skips files already copied.
    #[command(after_help = UNITS_HELP)]
    Copy(copy::CopyArgs),
    /// Serve checkpoints (local folders, or any URI fastload reads, filled into the local cache
    /// as they are served) to peers over HTTP range requests, with a manifest of each file's
    /// origin identity; prints `serving on http://ADDR:PORT` when ready, stops on SIGTERM/SIGINT.
    Serve(crate::serve::ServeArgs),
}

/// Why a command failed; printed as one line.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Load(#[from] crate::Error),
    /// A request this build cannot serve (e.g. a CUDA device).
    #[error("{0}")]
    Unsupported(String),
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("cannot write to stdout: {0}")]
    Stdout(io::Error),
}

type CliResult<T = ()> = Result<T, CliError>;

/// Where tensors should land. Parsed at the boundary so that a typo is a usage error.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    /// Staged through the copy engine into host memory: the GPU path's pipeline, without a GPU.
    Host,
    Cuda(Option<u32>),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "host" => return Ok(Device::Host),
            "cuda" => return Ok(Device::Cuda(None)),
            _ => {}
        }
        if let Some(n) = t.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            return Ok(Device::Cuda(Some(n)));
        }
        Err(format!(
            "{s:?} is not a device (use cpu, cuda, cuda:N or host)"
        ))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Host => f.write_str("host"),
            Device::Cuda(None) => f.write_str("cuda"),
            Device::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// The staged-load target, `None` for plain host-memory loads.
    fn target(&self) -> crate::Result<Option<crate::device::Target>> {
        match self {
            Device::Cpu => Ok(None),
            Device::Host => crate::device::rust_target("host").map(Some),
            Device::Cuda(n) => {
                crate::device::rust_target(&format!("cuda:{}", n.unwrap_or(0))).map(Some)
            }
        }
    }
}

/// The keyset of `--keyset FILE`: the path, read when the load opens (the JSON itself is refused:
/// a command line is visible to every user of the machine in `ps`; never shown, as either).
fn keyset_file(path: Option<&str>) -> CliResult<Option<crate::options::Secret>> {
    let Some(path) = path else { return Ok(None) };
    crate::error::remember_secret(path);
    if path.trim().trim_start_matches('\u{feff}').starts_with('{') {
        return Err(crate::Error::option(
            "keyset",
            "takes the path of a keyset file, not the keyset's JSON (a command line shows in \
             `ps`); the value is not shown",
        )
        .into());
    }
    Ok(Some(crate::options::Secret(zeroize::Zeroizing::new(
        path.to_string(),
    ))))
}

/// Writes `text` to stdout in one go; a closed pipe surfaces as [`CliError::Stdout`].
fn print_stdout(text: &str) -> CliResult {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(CliError::Stdout)
}

/// "1 file", "2 files".
fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// Bytes in decimal units (1 GB = 10^9 bytes), as throughput is reported.
fn decimal_bytes(n: u64) -> String {
    const UNITS: [(&str, f64); 4] = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    for (unit, scale) in UNITS {
        if n as f64 >= scale {
            return format!("{:.2} {unit}", n as f64 / scale);
        }
    }
    format!("{n} B")
}

/// A plain text table: first column left-aligned, the rest right-aligned unless listed.
struct Table {
    rows: Vec<Vec<String>>,
    left: Vec<usize>,
}

impl Table {
    fn new(header: &[&str], left: &[usize]) -> Table {
        Table {
            rows: vec![header.iter().map(|s| s.to_string()).collect()],
            left: left.to_vec(),
        }
    }

    fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    fn render(&self) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                let pad = widths[c] - cell.chars().count();
                if self.left.contains(&c) {
                    line.push_str(cell);
                    line.push_str(&" ".repeat(pad));
                } else {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_argument_that_is_not_utf8_becomes_a_file_uri() {
        use std::os::unix::ffi::OsStringExt;
        assert_eq!(arg_from_os("--json".into()), "--json");
        let raw = std::ffi::OsString::from_vec(b"/tmp/caf\xe9/w.safetensors".to_vec());
        let uri = arg_from_os(raw);
        assert_eq!(uri, "file:///tmp/caf%E9/w.safetensors");
        let back = url::Url::parse(&uri).unwrap().to_file_path().unwrap();
        assert_eq!(
            back.into_os_string().into_vec(),
            b"/tmp/caf\xe9/w.safetensors"
        );
    }

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("CUDA".parse::<Device>().unwrap(), Device::Cuda(None));
        assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Cuda(Some(1)));
        assert!("cuda:x".parse::<Device>().is_err());
        assert!("tpu".parse::<Device>().is_err());
        assert_eq!("host".parse::<Device>().unwrap(), Device::Host);
        assert!(Device::Cpu.target().unwrap().is_none());
        assert_eq!(
            Device::Host.target().unwrap().unwrap().engine.name(),
            "host"
        );
    }

    #[test]
    fn cuda_without_a_driver_is_a_clear_error() {
        if crate::device::cuda_available() {
            return; // a GPU machine: tests/test_gpu.py covers it
        }
        let err = Device::Cuda(Some(0))
            .target()
            .err()
            .expect("no driver here");
        // No driver, or a driver without a visible device (CUDA_VISIBLE_DEVICES="").
        let text = err.to_string();
        assert!(
            text.contains("CUDA driver not found") || text.contains("no CUDA device is visible"),
            "unexpected: {err}"
        );
    }

    #[test]
    fn formats_decimal_bytes() {
        assert_eq!(decimal_bytes(999), "999 B");
        assert_eq!(decimal_bytes(1_073_741_824), "1.07 GB");
    }

    #[test]
    fn renders_aligned_tables() {
        let mut t = Table::new(&["name", "n"], &[0]);
        t.push(vec!["a".into(), "100".into()]);
        assert_eq!(t.render(), "name    n\na     100\n");
    }

    // That a usage error returns its code instead of exiting the process is tested from Python
    // (tests/test_console.py), in a child whose stderr is captured: clap writes it directly.
}
