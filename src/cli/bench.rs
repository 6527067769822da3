//! `fastload bench`: load checkpoints the way a server would, time it, and report throughput and
//! time to first tensor per run (optionally over a grid of concurrency and block sizes).

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::{checkpoint, decimal_bytes, print_stdout, CliError, CliResult, Device};
use crate::options::{LoadOptions, Method, Resolved, Size};
use crate::source;

const SWEEP_CONCURRENCY: [usize; 5] = [4, 8, 16, 32, 64];
const SWEEP_BLOCK_MIB: [u64; 5] = [1, 4, 8, 16, 32];
/// Stride of the consumer's reads: one byte per page makes every page resident and readable
/// without turning the benchmark into a memory-bandwidth test.
const PAGE: usize = 4096;

#[derive(Args)]
pub(super) struct BenchArgs {
    /// Checkpoints to load: files, directories (every *.safetensors, or what
    /// model.safetensors.index.json names), index files or file:// URLs. None: a generated
    /// llama-like checkpoint (see --size).
    #[arg(value_name = "URI")]
    uris: Vec<String>,
    /// Reads in flight at once [default: $FASTLOAD_CONCURRENCY, else 16]
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// Bytes per read request, e.g. 8MiB or 1048576 [default: $FASTLOAD_BLOCK_SIZE, else 8MiB]
    #[arg(long, value_name = "SIZE")]
    block_size: Option<Size>,
    /// Bytes of host buffers the loader may hold at once, e.g. 1GiB [default:
    /// $FASTLOAD_MEMORY_LIMIT, else 1GiB]
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<Size>,
    /// How local files are read: auto (the loader picks), mmap (map the file and fault pages in
    /// from several threads) or read (pread into reused buffers) [default: $FASTLOAD_METHOD,
    /// else auto]
    #[arg(long, value_name = "METHOD", default_value = "auto", hide_default_value = true)]
    method: Method,
    /// Where tensors land: cpu (cuda and cuda:N are not supported by this build yet)
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: Device,
    /// Runs per configuration [default: 3, or 1 with --sweep]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: Option<u32>,
    /// Evict the files from the page cache before each run (posix_fadvise DONTNEED), so runs
    /// read from storage
    #[arg(long)]
    cold: bool,
    /// Print one JSON object on stdout (bytes, tensors, files, runs, best_gb_per_s, checksum and
    /// the options used) instead of the table
    #[arg(long)]
    json: bool,
    /// Try every concurrency in 4,8,16,32,64 with every block size in 1,4,8,16,32 MiB and report
    /// the best; --concurrency or --block-size pins that axis to one value
    #[arg(long)]
    sweep: bool,
    /// Size of the generated checkpoint used when no URI is given, e.g. 256MiB; it is cached in
    /// $FASTLOAD_CACHE_DIR, else in the user cache directory under fastload/
    #[arg(long, value_name = "SIZE", default_value = "1GiB", conflicts_with = "uris")]
    size: Size,
}

/// One timed load.
#[derive(Serialize, Clone, Debug)]
struct RunReport {
    /// 1-based, in the order the runs happened.
    run: usize,
    concurrency: usize,
    block_size: u64,
    /// The read strategy the loader used.
    method: &'static str,
    bytes: u64,
    tensors: usize,
    /// From opening the files (headers included) until the last tensor was read by the consumer.
    seconds: f64,
    /// Decimal: 10^9 bytes per second.
    gb_per_s: f64,
    /// From opening the files until the first tensor was available; null with no tensors.
    first_tensor_ms: Option<f64>,
    checksum: u64,
}

#[derive(Serialize)]
struct Grid {
    concurrency: Vec<usize>,
    block_size: Vec<u64>,
}

#[derive(Serialize)]
struct Report {
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
    cold: bool,
    repeat: u32,
    sweep: Option<Grid>,
    runs: Vec<RunReport>,
    best_run: usize,
    best_gb_per_s: f64,
    checksum: u64,
}

fn method_name(m: Method) -> &'static str {
    match m {
        Method::Auto => "auto",
        Method::Mmap => "mmap",
        Method::Read => "read",
    }
}

/// The option sets to run, each validated (FASTLOAD_* variables included) before anything runs.
fn configs(args: &BenchArgs) -> CliResult<Vec<(LoadOptions, Resolved)>> {
    let base = LoadOptions {
        concurrency: args.concurrency,
        block_size: args.block_size.map(|s| s.0),
        memory_limit: args.memory_limit.map(|s| s.0),
        names: None,
        method: args.method,
    };
    let mut out = Vec::new();
    if !args.sweep {
        let resolved = base.resolve()?;
        out.push((base, resolved));
        return Ok(out);
    }
    let concurrency: Vec<usize> = match args.concurrency {
        Some(c) => vec![c],
        None => SWEEP_CONCURRENCY.to_vec(),
    };
    let blocks: Vec<u64> = match args.block_size {
        Some(b) => vec![b.0],
        None => SWEEP_BLOCK_MIB.iter().map(|m| m << 20).collect(),
    };
    for &c in &concurrency {
        for &b in &blocks {
            let opts = LoadOptions {
                concurrency: Some(c),
                block_size: Some(b),
                ..base.clone()
            };
            let resolved = opts.resolve()?;
            out.push((opts, resolved));
        }
    }
    Ok(out)
}

/// Drops the file's pages from the page cache so the next read goes to storage.
#[allow(unsafe_code)]
fn evict(path: &Path) -> CliResult {
    let io_error = |source| CliError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    // SAFETY: posix_fadvise takes an open descriptor (kept alive by `file` for the call) and
    // plain integers; it does not touch this process's memory.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(io_error(std::io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

/// Reads one byte of every page (and the last byte), as a consumer of the tensors would.
fn touch_pages(bytes: &[u8]) -> u64 {
    let bytes = std::hint::black_box(bytes);
    let mut sum = bytes.last().map_or(0, |&b| b as u64);
    for i in (0..bytes.len()).step_by(PAGE) {
        sum = sum.wrapping_add(bytes[i] as u64);
    }
    std::hint::black_box(sum)
}

fn progress_bar(total: u64, label: String) -> ProgressBar {
    // Draws on stderr, and draws nothing when stderr is not a terminal.
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec}",
        )
        .expect("valid progress template")
        .progress_chars("=> "),
    );
    bar.set_message(label);
    bar
}

fn load_once(uris: &[String], opts: &LoadOptions, run: usize, label: String) -> CliResult<RunReport> {
    let resolved = opts.resolve()?;
    let started = Instant::now();
    let mut loader = crate::open(uris, opts)?;
    let bar = progress_bar(loader.plan().total_bytes, label);
    let (mut first, mut bytes, mut tensors, mut checksum) = (None, 0u64, 0usize, 0u64);
    while let Some(segment) = loader.next_segment() {
        let segment = segment?;
        first.get_or_insert_with(|| started.elapsed());
        checksum = checksum.wrapping_add(touch_pages(segment.buffer.as_slice()));
        let n: u64 = segment.tensors.iter().map(|t| t.len).sum();
        bytes += n;
        tensors += segment.tensors.len();
        bar.inc(n);
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(RunReport {
        run,
        concurrency: resolved.concurrency,
        block_size: resolved.block_size,
        method: method_name(loader.method()),
        bytes,
        tensors,
        seconds,
        gb_per_s: if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        },
        first_tensor_ms: first.map(|d| d.as_secs_f64() * 1e3),
        checksum,
    })
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

/// Fixed-width rows, so each can be printed as soon as its run ends.
fn row(r: &RunReport, sweep: bool) -> String {
    let first = r
        .first_tensor_ms
        .map_or_else(|| "-".into(), |ms| format!("{ms:.2} ms"));
    let config = if sweep {
        format!("{:>11}  {:>10}  ", r.concurrency, Size(r.block_size).to_string())
    } else {
        String::new()
    };
    format!(
        "{:>4}  {config}{:>14}  {:>8}  {:>8.4}  {:>7.3}  {first:>12}\n",
        r.run, r.bytes, r.tensors, r.seconds, r.gb_per_s
    )
}

fn header_row(sweep: bool) -> String {
    let config = if sweep {
        format!("{:>11}  {:>10}  ", "concurrency", "block size")
    } else {
        String::new()
    };
    format!(
        "{:>4}  {config}{:>14}  {:>8}  {:>8}  {:>7}  {:>12}\n",
        "run", "bytes", "tensors", "seconds", "GB/s", "first tensor"
    )
}

pub(super) fn run(args: BenchArgs) -> CliResult {
    args.device.check_supported()?;
    let configs = configs(&args)?;
    let uris = if args.uris.is_empty() {
        vec![checkpoint::ensure(args.size.0)?.display().to_string()]
    } else {
        args.uris.clone()
    };
    // Headers once up front: fails fast on a bad file, describes the load, lists files to evict.
    let shards = source::open_all(&uris)?;
    let files: Vec<PathBuf> = shards.iter().map(|s| s.path.clone()).collect();
    let tensors: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
    let bytes: u64 = shards.iter().map(|s| s.header.data_len()).sum();
    drop(shards);

    let repeat = args.repeat.unwrap_or(if args.sweep { 1 } else { 3 });
    let total = configs.len() * repeat as usize;
    let resolved = &configs[0].1;
    if !args.json {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let mut intro = format!(
            "fastload bench: {} ({} file{}, {tensors} tensor{}) from {}\n",
            decimal_bytes(bytes),
            files.len(),
            plural(files.len()),
            plural(tensors),
            uris.join(" ")
        );
        let config = if args.sweep {
            String::new()
        } else {
            format!(
                ", concurrency {}, block size {}",
                resolved.concurrency,
                Size(resolved.block_size)
            )
        };
        intro.push_str(&format!(
            "device {}, method {}{config}, memory limit {}, {} page cache, {total} run{}\n\n",
            args.device,
            method_name(resolved.method),
            Size(resolved.memory_limit),
            if args.cold { "cold" } else { "warm" },
            plural(total),
        ));
        intro.push_str(&header_row(args.sweep));
        print_stdout(&intro)?;
    }

    let mut runs: Vec<RunReport> = Vec::with_capacity(total);
    for (opts, resolved) in &configs {
        for _ in 0..repeat {
            if args.cold {
                files.iter().try_for_each(|f| evict(f))?;
            }
            let n = runs.len() + 1;
            let mut label = format!("run {n}/{total}");
            if args.sweep {
                label.push_str(&format!(
                    " c{} {}",
                    resolved.concurrency,
                    Size(resolved.block_size)
                ));
            }
            let report = load_once(&uris, opts, n, label)?;
            if !args.json {
                print_stdout(&row(&report, args.sweep))?;
            }
            runs.push(report);
        }
    }
    if runs.iter().any(|r| r.checksum != runs[0].checksum) {
        eprintln!("fastload: warning: runs read different bytes (checksums differ); did a file change?");
    }
    let best = runs
        .iter()
        .max_by(|a, b| a.gb_per_s.total_cmp(&b.gb_per_s))
        .expect("at least one run")
        .clone();

    if args.json {
        let report = Report {
            uris,
            files: files.len(),
            bytes: runs[0].bytes,
            tensors: runs[0].tensors,
            device: args.device.to_string(),
            method: method_name(resolved.method),
            method_used: best.method,
            concurrency: best.concurrency,
            block_size: best.block_size,
            memory_limit: resolved.memory_limit,
            cold: args.cold,
            repeat,
            sweep: args.sweep.then(|| Grid {
                concurrency: distinct(configs.iter().map(|c| c.1.concurrency)),
                block_size: distinct(configs.iter().map(|c| c.1.block_size)),
            }),
            best_run: best.run,
            best_gb_per_s: best.gb_per_s,
            checksum: best.checksum,
            runs,
        };
        let mut text = serde_json::to_string(&report).expect("the report serializes");
        text.push('\n');
        return print_stdout(&text);
    }
    let first = best
        .first_tensor_ms
        .map_or_else(String::new, |ms| format!(", first tensor {ms:.2} ms"));
    let config = if args.sweep {
        format!(
            ", concurrency {}, block size {}",
            best.concurrency,
            Size(best.block_size)
        )
    } else {
        String::new()
    };
    print_stdout(&format!(
        "\nbest: run {} (method {}{config}): {:.3} GB/s, {:.3} s{first}\n",
        best.run, best.method, best.gb_per_s, best.seconds
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touches_every_page() {
        let mut data = vec![0u8; 3 * PAGE + 10];
        data[0] = 1;
        data[PAGE] = 2;
        data[2 * PAGE] = 4;
        data[3 * PAGE] = 8;
        *data.last_mut().unwrap() = 16;
        assert_eq!(touch_pages(&data), 31);
        assert_eq!(touch_pages(&[]), 0);
    }
}
