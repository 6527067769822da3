//! `fastload bench`: load checkpoints the way a server would, time it, and report throughput and
//! time to first tensor per run (optionally over a grid of concurrency and block sizes), cold
//! and/or warm, beside the limits of the hardware measured on the same files (see
//! [`super::limits`]), and optionally beside the peer loaders ([`super::compare`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::compare::{self, Compare, PeerRuns, Peers};
use super::limits::{self, Limit};
use super::page_cache::{evict_all, touch_pages, warm_up};
use super::report::Setup;
use super::run::{ReadFrom, RunReport};
use super::verdict::ModeReport;
use super::{checkpoint, print_stdout, CliResult, Device};
use crate::options::{CacheChoice, LoadOptions, Method, Resolved, Size};
use crate::source;
use crate::Memory;

const SWEEP_CONCURRENCY: [usize; 5] = [4, 8, 16, 32, 64];
const SWEEP_BLOCK_MIB: [u64; 5] = [1, 4, 8, 16, 32];

#[derive(Args)]
pub(super) struct BenchArgs {
    /// Checkpoints to load: files, directories (every *.safetensors, or what
    /// model.safetensors.index.json names), index files or file:// URLs; objects or prefixes in
    /// object stores (s3://, gs://, az://, http(s)://) and the Hugging Face Hub (hf://), configured
    /// by their usual environment variables. None: a generated llama-like checkpoint (see --size).
    #[arg(value_name = "URI")]
    uris: Vec<String>,
    // boilerplate: the read flags as `copy` declares them, with bench's own help and defaults
    /// Reads in flight at once [default: $FASTLOAD_CONCURRENCY, else 16, or 64 for object stores]
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// Bytes per read request, e.g. 8MiB or 1048576 [default: $FASTLOAD_BLOCK_SIZE, else 8MiB]
    #[arg(long, value_name = "SIZE")]
    block_size: Option<Size>,
    /// Memory the loader may hold at once for tensors not yet handed out (host buffers; for a
    /// GPU load also the page-locked ring and device memory of tensors not yet yielded), e.g.
    /// 1GiB [default: $FASTLOAD_MEMORY_LIMIT, else 1GiB]
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<Size>,
    /// How local files are read: auto (the loader picks), mmap (map the file and fault pages in
    /// from several threads; with a GPU device, lend the file's pages to it where they are),
    /// read (pread into reused buffers; with a GPU device, into the page-locked ring) or direct
    /// (blocks not in the page cache read around it, O_DIRECT, into the buffers read uses)
    /// [default: $FASTLOAD_METHOD, else auto]
    #[arg(
        long,
        value_name = "METHOD",
        default_value = "auto",
        hide_default_value = true
    )]
    method: Method,
    /// Copy queues of a GPU load (CUDA streams, 1 to 16): blocks are copied to the device on
    /// each in turn [default: $FASTLOAD_COPY_STREAMS, else 1]
    #[arg(long, value_name = "N")]
    copy_streams: Option<usize>,
    /// Where tensors land: cpu; cuda or cuda:N (through page-locked staging buffers and async
    /// copies into device memory); host (the same staged pipeline into host memory, no GPU)
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: Device,
    /// Runs per configuration [default: 3, or 1 with --sweep]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: Option<u32>,
    /// Cold runs: evict the files from the page cache before each run (posix_fadvise
    /// DONTNEED), so runs read from storage. Without a URI, cold runs then warm runs are made
    /// unless --cold or --warm picks one; with a URI, warm runs unless --cold (both: cold then
    /// warm)
    #[arg(long)]
    cold: bool,
    /// Warm runs: the files are read once first, so runs read the page cache (see --cold)
    #[arg(long)]
    warm: bool,
    /// Load the same files with peer loaders too, each load in a fresh Python process, cold and
    /// warm as the runs, and print them side by side: by default the first installed of
    /// safetensors, runai-model-streamer, fastsafetensors, tensorizer, as one row beside
    /// fastload's runs (local files on --device cpu only); --compare or --compare=all: every
    /// installed peer, and fastload loaded the same way; --compare=PEER,...: those; --compare=none:
    /// no comparison. (A word after a bare --compare is its value when it names peers.)
    #[arg(
        long,
        value_name = "PEERS",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "all"
    )]
    compare: Option<Peers>,
    /// The Python the peers run in (it needs fastload and torch) [default: $FASTLOAD_PYTHON,
    /// else the Python that runs this fastload script, else python3]
    #[arg(long, value_name = "PATH")]
    python: Option<String>,
    /// Print one JSON object on stdout (bytes, tensors, files, runs, best_gb_per_s, checksum,
    /// the options used, limits, per-mode fractions of them and the comparison) instead of the
    /// table
    #[arg(long)]
    json: bool,
    /// Try every concurrency in 4,8,16,32,64 with every block size in 1,4,8,16,32 MiB and report
    /// the best; --concurrency or --block-size pins that axis to one value
    #[arg(long)]
    sweep: bool,
    /// Measure the limits that apply (storage, page cache, ranged GETs, host-to-device; each the
    /// best of --repeat passes) and print them, without timing any load; with --json, one object
    /// `{"uris", "bytes", "limits": {name: {gb_per_s, what, bytes}}}`
    #[arg(long, conflicts_with_all = ["compare", "sweep"])]
    limits_only: bool,
    /// Keep a local copy of remote objects in DIR (1: the default directory, 0: off), written
    /// while the first run streams; later runs read it [default: $FASTLOAD_CACHE, else off]
    #[arg(long, value_name = "DIR")]
    cache: Option<CacheChoice>,
    /// Read Tink-encrypted files with the keyset in FILE (a cleartext JSON keyset; never
    /// printed) [default: $FASTLOAD_KEYSET, its JSON or a path]
    #[arg(long, value_name = "FILE")]
    keyset: Option<String>,
    /// Read each file from the first of these serves (host:port or https://host:port) that
    /// holds its version, else from its origin (docs/peers.md) [default: $FASTLOAD_PEERS]
    #[arg(long, value_name = "HOST:PORT,...", value_delimiter = ',')]
    peers: Option<Vec<String>>,
    /// Size of the generated checkpoint used when no URI is given, e.g. 256MiB; it is cached in
    /// $FASTLOAD_CACHE_DIR, else in the user cache directory under fastload/
    #[arg(
        long,
        value_name = "SIZE",
        default_value = "1GiB",
        conflicts_with = "uris"
    )]
    size: Size,
    /// Remove the checkpoints generated for runs without a URI (every --size) from the cache
    /// directory, print what was removed, and exit
    #[arg(long, conflicts_with_all = ["uris", "limits_only", "compare", "sweep", "json"])]
    clean: bool,
}

/// The option sets to run, each validated (FASTLOAD_* variables included) before anything runs.
fn configs(args: &BenchArgs) -> CliResult<Vec<(LoadOptions, Resolved)>> {
    let base = LoadOptions {
        concurrency: args.concurrency,
        block_size: args.block_size.map(|s| s.0),
        memory_limit: args.memory_limit.map(|s| s.0),
        names: None,
        method: args.method,
        copy_streams: args.copy_streams,
        cache: args.cache.clone(),
        keyset: super::keyset_file(args.keyset.as_deref())?,
        peers: args.peers.clone(),
        ..Default::default()
    };
    let remote = crate::uri::any_remote(&args.uris);
    let mut out = Vec::new();
    if !args.sweep {
        let resolved = base.resolve(remote)?;
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
            let resolved = opts.resolve(remote)?;
            out.push((opts, resolved));
        }
    }
    Ok(out)
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

/// The checksum of one delivered segment: per tensor, so that it depends on the file's bytes
/// only, not on how a configuration cut the file into segments (every run of a sweep must agree).
/// Device memory is not read back: 0.
fn checksum(segment: &crate::Loaded) -> u64 {
    let mut sum = 0u64;
    match &segment.memory {
        Memory::Host(buffer) => {
            let data = buffer.as_slice();
            for t in &segment.tensors {
                let range = t.offset as usize..(t.offset + t.len) as usize;
                sum = sum.wrapping_add(touch_pages(&data[range]));
            }
        }
        Memory::Placed(destinations) => {
            for d in destinations {
                if let Some(bytes) = crate::device::host_bytes(d) {
                    sum = sum.wrapping_add(touch_pages(bytes));
                }
            }
        }
    }
    sum
}

/// One timed load. `local_files`: how many of the URIs' shards are files on this machine;
/// `evicted`: whether they were evicted before this run.
fn load_once(
    cache: &'static str,
    uris: &[String],
    opts: &LoadOptions,
    device: &Device,
    run: usize,
    label: String,
    (local_files, evicted): (usize, bool),
) -> CliResult<RunReport> {
    let resolved = opts.resolve(crate::uri::any_remote(uris))?;
    // Set up before the clock starts: the driver probe and the device context are paid once per
    // process by a server, not per load.
    let target = device.target()?;
    let started = Instant::now();
    let mut loader = match target {
        None => crate::open(uris, opts)?,
        Some(target) => crate::open_staged(uris, opts, target)?,
    };
    let plan = loader.plan();
    // A remote object read from a local copy is a local file in the plan.
    let read_from = ReadFrom::of_run(
        plan.shards.len(),
        plan.shards
            .iter()
            .filter(|s| s.local_path().is_some())
            .count(),
        local_files,
        evicted,
    );
    let segments = plan.segments.len();
    let bar = progress_bar(plan.total_bytes, label);
    let (mut first, mut bytes, mut tensors, mut checksum_sum) = (None, 0u64, 0usize, 0u64);
    // Tensors stay alive until the run ends, as after a load.
    let mut kept = Vec::new();
    while let Some(segment) = loader.next_segment() {
        let segment = segment?;
        first.get_or_insert_with(|| started.elapsed());
        checksum_sum = checksum_sum.wrapping_add(checksum(&segment));
        let n: u64 = segment.tensors.iter().map(|t| t.len).sum();
        bytes += n;
        tensors += segment.tensors.len();
        bar.inc(n);
        if matches!(segment.memory, Memory::Placed(_)) {
            kept.push(segment);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    drop(kept);
    let checksum = checksum_sum;
    Ok(RunReport {
        run,
        cache,
        read_from,
        concurrency: resolved.concurrency,
        block_size: resolved.block_size,
        method: loader.method().as_str(),
        lend_refused: loader.stats().lend_refused.get().cloned(),
        direct_refused: loader.stats().direct_refused.get().cloned(),
        bytes,
        tensors,
        segments,
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

/// What one load covers, from the headers alone (so a bad file fails before the first run).
struct Described {
    shard_list: Vec<source::Shard>,
    /// Local files, to evict with `--cold`.
    local: Vec<PathBuf>,
    /// Files and objects.
    shards: usize,
    /// Read with a keyset: the files hold ciphertext.
    encrypted: bool,
    tensors: usize,
    bytes: u64,
}

fn describe(uris: &[String], options: &LoadOptions) -> CliResult<Described> {
    let decryption = source::decrypt::Decryption::for_load(options)?;
    let shards = source::open::open_all(
        uris,
        &[],
        &crate::source::cache::CacheSettings::off(),
        &decryption,
    )?;
    Ok(Described {
        shard_list: shards.clone(),
        local: shards
            .iter()
            .filter_map(|s| s.local_path().map(|p| p.to_path_buf()))
            .collect(),
        shards: shards.len(),
        encrypted: decryption.enabled(),
        tensors: shards.iter().map(|s| s.header.tensors.len()).sum(),
        bytes: shards.iter().map(|s| s.header.data_len()).sum(),
    })
}

/// Every configuration `repeat` times in `cache` mode, each row printed as its run ends;
/// cold: whether eviction took effect.
fn execute(
    args: &BenchArgs,
    setup: &Setup<'_>,
    configs: &[LoadOptions],
    files: &[PathBuf],
    cache: &'static str,
    runs: &mut Vec<RunReport>,
) -> CliResult<bool> {
    let total = configs.len() * setup.repeat as usize * setup.modes.len();
    let mut evicted = true;
    let mut said = false;
    if cache == "warm" {
        warm_up(files);
    }
    for (opts, resolved) in configs.iter().zip(&setup.configs) {
        for _ in 0..setup.repeat {
            let this_run = cache == "cold" && evict_all(files, &mut said);
            evicted &= cache != "cold" || this_run;
            let n = runs.len() + 1;
            let mut label = format!("run {n}/{total} {cache}");
            if args.sweep {
                label.push_str(&format!(
                    " c{} {}",
                    resolved.concurrency,
                    Size(resolved.block_size)
                ));
            }
            let local = (files.len(), this_run);
            let run = load_once(cache, setup.uris, opts, &args.device, n, label, local)?;
            // With --cache, the next run reads the copy this one filled, once it is published
            // (outside the clock).
            crate::source::cache::wait_published();
            if !args.json {
                print_stdout(&setup.row(&run))?;
            }
            runs.push(run);
        }
    }
    Ok(evicted)
}

/// Measures the limits that apply to `cache` runs (adding them to `limits`); returns their names.
fn measure_limits(
    args: &BenchArgs,
    described: &Described,
    resolved: &Resolved,
    cache: &'static str,
    times: u32,
    limits: &mut BTreeMap<&'static str, Limit>,
) -> CliResult<Vec<&'static str>> {
    let files = &described.local;
    let mut names = Vec::new();
    if described.local.len() < described.shards {
        if !limits.contains_key("ranged_get") {
            let l = Limit::best_of(times, || {
                limits::ranged_get(
                    &described.shard_list,
                    resolved.concurrency,
                    resolved.block_size,
                )
            });
            limits.insert("ranged_get", l);
        }
        names.push("ranged_get");
    } else if cache == "cold" {
        let mut said = true;
        let direct = Limit::best_of(times, || {
            evict_all(files, &mut said);
            limits::storage_direct(files, resolved.concurrency, resolved.block_size)
        });
        let buffered = Limit::best_of(times, || {
            evict_all(files, &mut said);
            limits::buffered(
                files,
                limits::COLD_READERS,
                resolved.block_size,
                "cold, through the page cache",
            )
        });
        limits.insert("storage_direct", direct);
        limits.insert("storage_buffered", buffered);
        // The storage delivers whichever of the two is faster.
        let direct = limits["storage_direct"].gb_per_s.unwrap_or(0.0);
        let buffered = limits["storage_buffered"].gb_per_s.unwrap_or(0.0);
        names.push(if direct >= buffered {
            "storage_direct"
        } else {
            "storage_buffered"
        });
    } else {
        warm_up(files);
        let l = Limit::best_of(times, || {
            limits::buffered(
                files,
                limits::warm_readers(),
                resolved.block_size,
                "page-cache copy of the warm files",
            )
        });
        limits.insert("page_cache", l);
        names.push("page_cache");
        // What a mapped run does instead of copying: map, then touch every page.
        let l = Limit::best_of(times, || {
            limits::mapped_touch(files, limits::warm_readers())
        });
        limits.insert("mapped_touch", l);
        names.push("mapped_touch");
    }
    if matches!(args.device, Device::Cuda(_)) {
        if !limits.contains_key("host_to_device") {
            let target = args.device.target()?;
            // No more page-locked memory than the loader may hold.
            let block = resolved.block_size.min(resolved.memory_limit);
            let l = limits::host_to_device(target, described.bytes, block, times)?;
            limits.insert("host_to_device", l);
        }
        names.push("host_to_device");
    }
    Ok(names)
}

/// The cache modes to run, in order.
fn modes(args: &BenchArgs) -> Vec<&'static str> {
    match (args.cold, args.warm) {
        (true, true) => vec!["cold", "warm"],
        (true, false) => vec!["cold"],
        (false, true) => vec!["warm"],
        (false, false) if args.uris.is_empty() => vec!["cold", "warm"],
        (false, false) => vec!["warm"],
    }
}

/// `host_python`: the interpreter this CLI runs in, when it runs in one (the default Python of
/// the comparison).
pub(super) fn run(args: BenchArgs, host_python: Option<&str>) -> CliResult {
    if args.clean {
        return print_stdout(&checkpoint::clean()?);
    }
    // Fails early, before a checkpoint is generated, when the device cannot be used.
    drop(args.device.target()?);
    let (configs, resolved): (Vec<_>, Vec<_>) = configs(&args)?.into_iter().unzip();
    let uris = if args.uris.is_empty() {
        vec![checkpoint::ensure(args.size.0)?.display().to_string()]
    } else {
        args.uris.clone()
    };
    let described = describe(&uris, &configs[0])?;
    let setup = setup(&args, &uris, &described, &configs[0], resolved)?;
    if !args.json && !args.limits_only {
        print_stdout(&setup.intro())?;
    }
    let (runs, limits, reports) = run_modes(&args, &setup, &configs, &described)?;
    if args.limits_only {
        return print_stdout(&if args.json {
            setup.limits_json(&limits)
        } else {
            setup.limits_table(&limits)
        });
    }
    if runs.iter().any(|r| r.checksum != runs[0].checksum) {
        eprintln!(
            "fastload: warning: runs read different bytes (checksums differ); did a file change?"
        );
    }
    if !args.json {
        print_stdout(&setup.summary(&runs, &limits, &reports))?;
    }
    let compared = compare_peers(&args, host_python, &described, &setup, &runs, &reports)?;
    if let (Some(c), false) = (&compared, args.json) {
        print_stdout(&c.table(&setup.modes))?;
    }
    if args.json {
        print_stdout(&setup.json(&runs, &limits, &reports, compared.as_ref()))
    } else {
        Ok(())
    }
}

/// What the runs read and how: the benchmark's setup, as its intro and report show it.
fn setup<'a>(
    args: &'a BenchArgs,
    uris: &'a [String],
    described: &Described,
    first: &LoadOptions,
    resolved: Vec<Resolved>,
) -> CliResult<Setup<'a>> {
    let modes = modes(args);
    let remote = described.local.len() < described.shards;
    if modes.contains(&"cold") && remote {
        eprintln!(
            "fastload: note: --cold evicts local files only; objects are read over the network \
             every run"
        );
    }
    Ok(Setup {
        uris,
        files: described.shards,
        bytes: described.bytes,
        tensors: described.tensors,
        device: &args.device,
        configs: resolved,
        repeat: args.repeat.unwrap_or(if args.sweep { 1 } else { 3 }),
        modes,
        sweep: args.sweep,
        remote,
        local_files: described.local.len(),
        cache_dir: crate::source::cache::CacheSettings::for_load(first)?
            .dir
            .map(|d| d.display().to_string()),
        generated: args.uris.is_empty(),
    })
}

type Limits = BTreeMap<&'static str, Limit>;
type Reports = BTreeMap<&'static str, ModeReport>;

/// Each cache mode in turn: its limits measured, then (but with `--limits-only`) its runs.
fn run_modes(
    args: &BenchArgs,
    setup: &Setup<'_>,
    configs: &[LoadOptions],
    described: &Described,
) -> CliResult<(Vec<RunReport>, Limits, Reports)> {
    let mut runs = Vec::new();
    let mut limits = BTreeMap::new();
    let mut reports = BTreeMap::new();
    for &cache in &setup.modes {
        let applicable = measure_limits(
            args,
            described,
            &setup.configs[0],
            cache,
            setup.repeat,
            &mut limits,
        )?;
        if args.limits_only {
            continue;
        }
        let start = runs.len();
        let evicted = execute(args, setup, configs, &described.local, cache, &mut runs)?;
        let mine: Vec<&RunReport> = runs[start..].iter().collect();
        let evicted = (cache == "cold" && !described.local.is_empty()).then_some(evicted);
        reports.insert(cache, ModeReport::new(&mine, evicted, &limits, &applicable));
    }
    Ok((runs, limits, reports))
}

/// The comparison with other loaders that `--compare` asks for (by default, where a peer loads
/// what fastload's runs loaded), given fastload's own runs.
fn compare_peers(
    args: &BenchArgs,
    host_python: Option<&str>,
    described: &Described,
    setup: &Setup<'_>,
    runs: &[RunReport],
    reports: &Reports,
) -> CliResult<Option<Compare>> {
    let peers = args.compare.clone().unwrap_or(Peers::Default);
    // The default row only where a peer loads what fastload's runs loaded: local files into
    // host memory.
    let comparable = args.device == Device::Cpu && !setup.remote;
    match peers {
        Peers::None => return Ok(None),
        Peers::Default if !comparable => return Ok(None),
        _ => {}
    }
    let mut mine = BTreeMap::new();
    for (&mode, report) in reports {
        let seconds = runs.iter().filter(|r| r.cache == mode).map(|r| r.seconds);
        mine.insert(
            mode,
            PeerRuns {
                seconds: seconds.collect(),
                bytes: described.bytes,
                best_gb_per_s: report.best_gb_per_s,
                // Loaded in this process, which imports nothing to load.
                imported_in_clock: Default::default(),
            },
        );
    }
    let python = compare::python(args.python.as_deref(), host_python);
    let job = (&peers, mine, python);
    let compared = run_compare(args, job, setup.uris, described, setup, &setup.modes)?;
    Ok(Some(compared))
}

fn run_compare(
    args: &BenchArgs,
    (peers, runs, python): (&Peers, BTreeMap<&'static str, PeerRuns>, String),
    uris: &[String],
    described: &Described,
    setup: &Setup<'_>,
    modes: &[&'static str],
) -> CliResult<Compare> {
    let mut options = serde_json::Map::new();
    if let Some(c) = args.concurrency {
        options.insert("concurrency".into(), c.into());
    }
    if let Some(b) = args.block_size {
        options.insert("block_size".into(), b.0.into());
    }
    if let Some(m) = args.memory_limit {
        options.insert("memory_limit".into(), m.0.into());
    }
    if args.method != Method::Auto {
        options.insert("method".into(), args.method.as_str().into());
    }
    if let Some(n) = args.copy_streams {
        options.insert("copy_streams".into(), n.into());
    }
    // The file's path (never its content): fastload's row reads the files as this run does.
    if let Some(keyset) = &args.keyset {
        options.insert("keyset".into(), keyset.clone().into());
    }
    let default = *peers == Peers::Default;
    let job = compare::Job {
        python,
        peers,
        runs,
        uris,
        files: &described.local,
        remote: described.local.len() < described.shards,
        encrypted: described.encrypted,
        options,
        modes,
        repeat: setup.repeat,
        // The default comparison prints its one row at the end.
        print: !args.json && !default,
    };
    if !args.json && !default {
        print_stdout(&format!(
            "\ncomparing, each load in a fresh process of {}:\n",
            job.python
        ))?;
    }
    let files = &described.local;
    let evict = || {
        let mut said = true;
        evict_all(files, &mut said)
    };
    let warm = || warm_up(files);
    compare::run(
        &job,
        &compare::Hooks {
            evict: &evict,
            warm: &warm,
        },
    )
}
