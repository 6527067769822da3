//! The `fastload` binary end to end: bench and inspect on small files written here, the generated
//! checkpoint cache, and the error contract (one `fastload: error:` line, exit code 1).

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_fastload");

/// Writes a safetensors file holding `tensors` (name, dtype, shape, element size) with patterned
/// bytes; returns the bytes of tensor data.
fn write_safetensors(path: &Path, tensors: &[(&str, &str, &[u64], u64)]) -> u64 {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, item) in tensors {
        let len = shape.iter().product::<u64>() * item;
        let begin = data.len() as u64;
        data.extend((0..len).map(|i| (i % 251) as u8));
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + len]}),
        );
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&data);
    fs::write(path, bytes).unwrap();
    data.len() as u64
}

fn sample(dir: &Path) -> (PathBuf, u64) {
    let path = dir.join("model.safetensors");
    let bytes = write_safetensors(
        &path,
        &[
            ("embed", "BF16", &[300, 64], 2),
            ("layer.0.weight", "F32", &[64, 64], 4),
            ("layer.0.bias", "F32", &[64], 4),
            ("scalar", "I64", &[], 8),
            ("empty", "F16", &[0, 4], 2),
            ("big", "U8", &[3 << 20], 1),
        ],
    );
    (path, bytes)
}

fn fastload(args: &[&str], cache: Option<&Path>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for var in [
        "FASTLOAD_CONCURRENCY",
        "FASTLOAD_BLOCK_SIZE",
        "FASTLOAD_MEMORY_LIMIT",
        "FASTLOAD_METHOD",
    ] {
        cmd.env_remove(var);
    }
    match cache {
        Some(dir) => cmd.env("FASTLOAD_CACHE_DIR", dir),
        None => cmd.env_remove("FASTLOAD_CACHE_DIR"),
    };
    cmd.output().expect("the fastload binary runs")
}

/// The stdout of a run that must have succeeded.
fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}, stderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8")
}

fn json_of(out: &Output) -> Value {
    serde_json::from_str(&stdout_of(out)).expect("stdout is one JSON object")
}

/// Exit code 1 and exactly one `fastload: error:` line on stderr; returns that line.
fn error_line(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr.clone()).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "stderr: {stderr}");
    assert!(
        lines[0].starts_with("fastload: error: "),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty());
    lines[0].to_string()
}

#[test]
fn bench_json_reports_the_file_totals() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = sample(dir.path());
    let p = path.to_str().unwrap();
    let mut checksums = Vec::new();
    for method in ["auto", "mmap", "read"] {
        let out = fastload(
            &[
                "bench",
                p,
                "--json",
                "--repeat",
                "2",
                "--method",
                method,
                "--block-size",
                "1MiB",
                "--concurrency",
                "4",
                "--memory-limit",
                "8MiB",
                "--compare=none",
            ],
            None,
        );
        let v = json_of(&out);
        assert_eq!(v["bytes"], bytes);
        assert_eq!(v["tensors"], 6);
        assert_eq!(v["files"], 1);
        assert_eq!(v["concurrency"], 4);
        assert_eq!(v["block_size"], 1 << 20);
        assert_eq!(v["memory_limit"], 8 << 20);
        assert_eq!(v["method"], method);
        assert_eq!(v["device"], "cpu");
        assert_eq!(v["cold"], false);
        assert_eq!(v["uris"][0], p);
        let runs = v["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2);
        for run in runs {
            assert!(run["seconds"].as_f64().unwrap() > 0.0);
            assert!(run["gb_per_s"].as_f64().unwrap() > 0.0);
            assert!(run["first_tensor_ms"].as_f64().unwrap() >= 0.0);
            assert_eq!(run["bytes"], bytes);
            assert_eq!(run["checksum"], v["checksum"]);
        }
        let best = runs
            .iter()
            .map(|r| r["gb_per_s"].as_f64().unwrap())
            .fold(0.0, f64::max);
        assert_eq!(v["best_gb_per_s"].as_f64().unwrap(), best);
        // With a URI: warm runs only, beside the page-cache copy rate of the same files.
        assert!(runs.iter().all(|r| r["cache"] == "warm"), "{v}");
        assert!(runs.iter().all(|r| r["read_from"] == "page_cache"), "{v}");
        let warm = &v["modes"]["warm"];
        assert_eq!(warm["best_gb_per_s"], v["best_gb_per_s"]);
        assert_eq!(warm["read_from"], "page_cache");
        let limit = &v["limits"]["page_cache"];
        assert!(limit["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
        assert!(limit["bytes"].as_u64().unwrap() >= bytes, "{v}");
        // --compare=none: no peer beside it.
        assert!(v["modes"].get("cold").is_none() && v.get("compare").is_none());
        // The spread of the runs; the verdict judges the median.
        let rates: Vec<f64> = runs
            .iter()
            .map(|r| r["gb_per_s"].as_f64().unwrap())
            .collect();
        let median = (rates[0] + rates[1]) / 2.0;
        assert_eq!(warm["runs"], 2);
        assert_eq!(
            warm["min_gb_per_s"].as_f64().unwrap(),
            rates[0].min(rates[1])
        );
        assert!((warm["median_gb_per_s"].as_f64().unwrap() - median).abs() < 1e-9);
        // A mapped load copies nothing: the page-cache copy rate does not bound it, the mapping
        // touched page by page does.
        let (name, limit) = if v["method_used"] == "mmap" {
            ("mapped_touch", &v["limits"]["mapped_touch"])
        } else {
            ("page_cache", limit)
        };
        assert_eq!(warm["limit"], name, "{v}");
        let fraction = warm["fraction_of_limit"].as_f64().unwrap();
        assert!(
            (fraction - median / limit["gb_per_s"].as_f64().unwrap()).abs() < 1e-9,
            "{v}"
        );
        let bound = if fraction > 1.25 {
            "above the limit measured"
        } else if fraction >= 0.8 {
            name
        } else {
            "fastload"
        };
        assert_eq!(warm["bound_by"], bound);
        checksums.push(v["checksum"].as_u64().unwrap());
    }
    // The staged pipeline of the GPU path, into host memory: the same bytes arrive.
    let out = fastload(
        &[
            "bench",
            p,
            "--json",
            "--repeat",
            "2",
            "--device",
            "host",
            "--block-size",
            "64KiB",
            "--memory-limit",
            "1MiB",
        ],
        None,
    );
    let v = json_of(&out);
    assert_eq!(v["device"], "host");
    assert_eq!(v["bytes"], bytes);
    checksums.push(v["checksum"].as_u64().unwrap());
    // The checksum depends on the bytes only: every read strategy must see the same.
    assert!(
        checksums.iter().all(|&c| c == checksums[0]),
        "{checksums:?}"
    );
}

#[test]
fn bench_table_cold_and_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = sample(dir.path());
    let p = path.to_str().unwrap();
    // No --compare: a peer beside fastload's runs, or one line saying why there is none.
    let args = [
        "bench",
        p,
        "--cold",
        "--repeat",
        "1",
        "--python",
        "/nonexistent/py",
    ];
    let text = stdout_of(&fastload(&args, None));
    assert!(
        text.contains("GB/s") && text.contains("first tensor"),
        "{text}"
    );
    assert!(text.contains(&bytes.to_string()), "{text}");
    assert!(text.contains("cold page cache, 1 run\n") && text.contains("\ncold, 1 run: run 1 ("));
    // Where the run read from: the storage, once evicted (not on tmpfs).
    assert!(text.contains("run  read from "), "{text}");
    assert!(
        text.contains("   1  storage ") || text.contains("eviction did not take effect"),
        "{text}"
    );
    // The cold limits of the storage, measured on the same file, and what binds.
    assert!(text.contains("storage_direct") && text.contains("storage_buffered"));
    assert!(
        ["bound by", "ran low here", "no limit that applies"]
            .iter()
            .any(|v| text.contains(v)),
        "{text}"
    );
    // Never the old "at the limit (noise)"; "(at the limit, within noise)" is the verdict of a
    // run just above its limit, which a cold run here may or may not be (verdict.rs's unit
    // tests pin where noise ends).
    assert!(!text.contains("(noise)"), "{text}");
    let no_peer: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("peer") || l.contains("not run"))
        .collect();
    assert_eq!(no_peer.len(), 1, "{text}");
    assert!(
        no_peer[0].starts_with("no peer beside it: cannot run /nonexistent/py: ")
            && no_peer[0].ends_with("--compare none drops this line)"),
        "{text}"
    );

    // Both: cold runs, then warm runs, each labelled, each beside its own limit.
    let v = json_of(&fastload(
        &[
            "bench",
            p,
            "--cold",
            "--warm",
            "--repeat",
            "2",
            "--json",
            "--compare=none",
        ],
        None,
    ));
    let caches = run_caches(&v);
    assert_eq!(caches, ["cold", "cold", "warm", "warm"]);
    assert_eq!(v["cold"], true);
    assert_eq!(v["best_run"], v["modes"]["cold"]["best_run"]);
    assert!(v["modes"]["cold"]["best_run"].as_u64().unwrap() <= 2);
    assert!(v["modes"]["warm"]["best_run"].as_u64().unwrap() >= 3);
    if v["modes"]["cold"]["evicted"] == true {
        assert_eq!(v["modes"]["cold"]["read_from"], "storage");
        let cold_limit = v["modes"]["cold"]["limit"].as_str().unwrap_or("");
        assert!(
            cold_limit.starts_with("storage_")
                || v["modes"]["cold"]["bound_by"] == "no limit measured",
            "{v}"
        );
    }
    let warm = &v["modes"]["warm"];
    assert_eq!(warm["read_from"], "page_cache");
    if v["runs"][2]["method"] == "mmap" {
        assert_eq!(warm["limit"], "mapped_touch", "{v}");
    } else {
        assert_eq!(warm["limit"], "page_cache");
    }
    // O_DIRECT: a rate, or why it could not be measured here (tmpfs refuses it).
    let direct = &v["limits"]["storage_direct"];
    assert!(
        direct["gb_per_s"].as_f64().is_some_and(|r| r > 0.0)
            || direct["what"]
                .as_str()
                .unwrap()
                .starts_with("not measurable here"),
        "{v}"
    );

    let v = json_of(&fastload(
        &[
            "bench",
            p,
            "--sweep",
            "--block-size",
            "1MiB",
            "--json",
            "--compare=none",
        ],
        None,
    ));
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 5);
    assert!(runs.iter().all(|r| r["checksum"] == v["checksum"]));
    assert_eq!(
        v["sweep"]["concurrency"],
        serde_json::json!([4, 8, 16, 32, 64])
    );
    assert_eq!(v["sweep"]["block_size"], serde_json::json!([1 << 20]));
}

#[test]
fn bench_limits_only_measures_without_loading() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = sample(dir.path());
    let p = path.to_str().unwrap();
    let args = ["bench", p, "--limits-only", "--cold", "--warm"];
    let v = json_of(&fastload(
        &[&args[..], &["--json", "--repeat", "3"]].concat(),
        None,
    ));
    assert_eq!(v["bytes"], bytes);
    assert!(v.get("runs").is_none(), "{v}");
    for name in ["storage_direct", "storage_buffered", "page_cache"] {
        let limit = &v["limits"][name];
        assert!(limit.is_object(), "{name}: {v}");
        let what = limit["what"].as_str().unwrap();
        // Each measurable limit is the best of as many passes as --repeat, each counted.
        if limit["gb_per_s"].is_f64() {
            assert!(what.ends_with("best of 3"), "{v}");
            assert!(limit["bytes"].as_u64().unwrap() >= 3 * bytes, "{v}");
        } else {
            assert!(what.starts_with("not measurable here"), "{v}");
        }
    }
    let text = stdout_of(&fastload(&args, None));
    assert!(text.contains("limits, measured just now"), "{text}");
    assert!(
        !text.contains("best:") && !text.contains("GB/s, "),
        "{text}"
    );
}

#[test]
fn inspect_lists_every_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = sample(dir.path());
    let p = path.to_str().unwrap();
    let v = json_of(&fastload(&["inspect", p, "--json"], None));
    assert_eq!(
        v["total"],
        serde_json::json!({"files": 1, "tensors": 6, "bytes": bytes})
    );
    let tensors = v["tensors"].as_array().unwrap();
    let embed = tensors.iter().find(|t| t["name"] == "embed").unwrap();
    assert_eq!(embed["dtype"], "BF16");
    assert_eq!(embed["shape"], serde_json::json!([300, 64]));
    assert_eq!(embed["bytes"], 300 * 64 * 2);
    assert_eq!(embed["file"], p);
    let scalar = tensors.iter().find(|t| t["name"] == "scalar").unwrap();
    assert_eq!(scalar["shape"], serde_json::json!([]));
    assert_eq!(v["files"][0]["size"], fs::metadata(&path).unwrap().len());

    let text = stdout_of(&fastload(&["inspect", dir.path().to_str().unwrap()], None));
    assert!(text.contains("layer.0.weight") && text.contains("[64, 64]"));
    assert!(text.contains(&format!("total: 1 file, 6 tensors, {bytes} bytes")));
}

#[test]
fn errors_are_one_line_with_exit_code_1() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    let missing = missing.to_str().unwrap();
    for cmd in ["bench", "inspect"] {
        let line = error_line(&fastload(&[cmd, missing], None));
        assert!(line.contains(missing), "{line}");
    }

    let bad = dir.path().join("bad.safetensors");
    fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": nonsense}").unwrap();
    let bad = bad.to_str().unwrap();
    for cmd in ["bench", "inspect"] {
        let line = error_line(&fastload(&[cmd, bad], None));
        assert!(
            line.contains(bad) && line.contains("invalid safetensors"),
            "{line}"
        );
    }

    let (good, _) = sample(dir.path());
    let good = good.to_str().unwrap();
    if !fastload::device::cuda_available() {
        let line = error_line(&fastload(&["bench", good, "--device", "cuda"], None));
        assert!(
            line.starts_with("fastload: error: CUDA driver not found"),
            "{line}"
        );
    }
    if !fastload::device::cuda_available() {
        // --method applies to GPU loads too (mmap: the files' pages lent to the device).
        let line = error_line(&fastload(
            &["bench", good, "--device", "cuda:0", "--method", "mmap"],
            None,
        ));
        assert!(
            line.starts_with("fastload: error: CUDA driver not found"),
            "{line}"
        );
    }
    let line = error_line(&fastload(&["bench", good, "--concurrency", "0"], None));
    assert!(line.contains("concurrency"), "{line}");
    error_line(&fastload(&["bench", "s3://bucket/model.safetensors"], None));

    // Usage errors are clap's: its message and exit code 2.
    let out = fastload(&["bench", good, "--block-size", "12XB"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("12XB"));
    assert_eq!(fastload(&["inspect"], None).status.code(), Some(2));
}

#[test]
fn help_and_version() {
    let help = stdout_of(&fastload(&["bench", "--help"], None));
    for option in [
        "--concurrency",
        "--block-size",
        "--memory-limit",
        "--method",
        "--device",
        "--repeat",
        "--cold",
        "--json",
        "--sweep",
        "--size",
        "MiB",
        // An optional value: `--compare`, `--compare=all`, `--compare=none`, or peers.
        "--compare[=<PEERS>]",
        "runai-model-streamer",
    ] {
        assert!(help.contains(option), "{option} missing from:\n{help}");
    }
    assert_eq!(
        stdout_of(&fastload(&["--version"], None)).trim(),
        format!("fastload {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bench_without_uri_generates_once_and_reuses() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let args = [
        "bench",
        "--size",
        "8MiB",
        "--repeat",
        "1",
        "--json",
        "--compare=none",
    ];

    let first = fastload(&args, Some(&cache));
    let v = json_of(&first);
    // No URI: cold runs and warm runs, told apart; the headline is the cold one.
    let caches = run_caches(&v);
    assert_eq!(caches, ["cold", "warm"]);
    assert_eq!(v["cold"], true);
    assert_eq!(v["best_run"], 1);
    assert_eq!(v["best_gb_per_s"], v["runs"][0]["gb_per_s"]);
    for mode in ["cold", "warm"] {
        let m = &v["modes"][mode];
        assert!(m["bound_by"].is_string(), "{v}");
    }
    assert!(v["modes"]["cold"]["evicted"].is_boolean(), "{v}");
    let files: Vec<PathBuf> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(
        name.contains("8MiB") && name.ends_with(".safetensors"),
        "{name}"
    );
    assert_eq!(v["uris"][0], file.to_str().unwrap());
    let bytes = v["bytes"].as_u64().unwrap();
    assert!(bytes <= 8 << 20 && bytes > 8_000_000, "{bytes}");
    assert!(String::from_utf8_lossy(&first.stderr).contains(file.to_str().unwrap()));

    let inode = fs::metadata(file).unwrap().ino();
    let second = json_of(&fastload(&args, Some(&cache)));
    assert_eq!(fs::metadata(file).unwrap().ino(), inode, "regenerated");
    assert_eq!(second["bytes"], bytes);
    assert_eq!(second["checksum"], v["checksum"]);
    assert_eq!(fs::read_dir(&cache).unwrap().count(), 1);

    // The generated file is what `inspect` sees too.
    let listing = json_of(&fastload(
        &["inspect", file.to_str().unwrap(), "--json"],
        None,
    ));
    assert_eq!(listing["total"]["bytes"], bytes);
    assert_eq!(listing["total"]["tensors"], v["tensors"]);

    // The table says which runs are cold and which warm, and gives each its own best.
    let text = stdout_of(&fastload(
        &["bench", "--size", "8MiB", "--repeat", "1", "--compare=none"],
        Some(&cache),
    ));
    let evicted = v["modes"]["cold"]["evicted"] == true;
    for want in [
        "cold, then warm page cache",
        if evicted {
            "   1  storage "
        } else {
            "   1  page cache "
        },
        "   2  page cache ",
        "\ncold, 1 run: run 1 (",
        "\nwarm, 1 run: run 2 (page cache, method ",
        "page_cache",
        "mapped_touch",
        // Above the six rows: how many runs each mode has.
        "cold, then warm page cache, 1 run per mode\n",
        // Where the generated checkpoint is kept, and how to remove it.
        &format!("from {}\n(generated once and kept there", file.display()),
        "`fastload bench --clean` removes it)",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }

    // --clean removes it (and only generated checkpoints), and says so.
    fs::write(cache.join("mine.safetensors"), b"not generated").unwrap();
    let removed = stdout_of(&fastload(&["bench", "--clean"], Some(&cache)));
    assert!(
        removed.starts_with(&format!("removed {} (", file.display())),
        "{removed}"
    );
    assert!(!file.exists() && cache.join("mine.safetensors").exists());
    let again = stdout_of(&fastload(&["bench", "--clean"], Some(&cache)));
    assert_eq!(
        again,
        format!(
            "nothing to remove: no generated checkpoint in {}\n",
            cache.display()
        )
    );
}

/// The `cache` mode ("cold" or "warm") of each run in a bench report, in order.
fn run_caches(report: &serde_json::Value) -> Vec<&str> {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["cache"].as_str().unwrap())
        .collect()
}

#[test]
fn copy_copies_a_folder_skips_it_on_a_rerun_and_refuses_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = sample(dir.path());
    let dst = dir.path().join("out");
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let first = fastload(&["copy", s, &format!("{d}/")], None);
    assert!(first.status.success(), "{first:?}");
    let name = src.file_name().unwrap();
    assert_eq!(fs::read(dst.join(name)).unwrap(), fs::read(&src).unwrap());
    let text = String::from_utf8(first.stderr).unwrap();
    assert!(text.contains("copied 1 file"), "{text}");
    let again = fastload(&["copy", s, &format!("{d}/")], None);
    let text = String::from_utf8(again.stderr).unwrap();
    assert!(
        text.contains("copied 0 files") && text.contains("skipped 1 file"),
        "{text}"
    );
    // Another file where the copy would go: refused, named, left alone.
    let other = dir.path().join("other.bin");
    fs::write(&other, b"other").unwrap();
    let line = error_line(&fastload(&["copy", other.to_str().unwrap(), s], None));
    assert!(
        line.contains(s) && line.contains("already exists"),
        "{line}"
    );
    let missing = dir.path().join("missing");
    let line = error_line(&fastload(&["copy", missing.to_str().unwrap(), d], None));
    assert!(line.contains("missing"), "{line}");
}
