//! `fastload inspect`: what a checkpoint holds, from its headers alone.

use std::collections::BTreeMap;
use std::path::Path;

use clap::Args;
use serde::Serialize;

use super::{decimal_bytes, plural, print_stdout, CliResult, Table};
use crate::source::{self, Shard};

#[derive(Args)]
pub(super) struct InspectArgs {
    /// Files, directories (every *.safetensors, or what model.safetensors.index.json names),
    /// index files or file:// URLs; objects or prefixes in object stores (s3://, gs://, az://,
    /// http(s)://) and the Hugging Face Hub (hf://org/repo[@revision][/path]), configured by
    /// their usual environment variables. Only the headers are read.
    #[arg(required = true, value_name = "URI")]
    uris: Vec<String>,
    /// Print one JSON object on stdout instead of the table, the one `fastload.inspect` returns:
    /// {"files": [{file, size, header_bytes, tensors, bytes, metadata}], "tensors": [{name,
    /// dtype, shape, bytes, file, data_offsets}], "total": {files, tensors, bytes}}
    #[arg(long)]
    json: bool,
    /// Read Tink-encrypted files with the keyset in FILE (a cleartext JSON keyset; never
    /// printed) [default: $FASTLOAD_KEYSET, its JSON or a path]
    #[arg(long, value_name = "FILE")]
    keyset: Option<String>,
}

/// The metadata a file without `__metadata__` reports.
static EMPTY: BTreeMap<String, String> = BTreeMap::new();

#[derive(Serialize)]
struct FileReport<'a> {
    file: &'a str,
    /// Bytes of the whole file.
    size: u64,
    /// Bytes before the data section (length prefix and JSON header).
    header_bytes: u64,
    tensors: usize,
    /// Bytes of tensor data.
    bytes: u64,
    metadata: &'a BTreeMap<String, String>,
}

#[derive(Serialize)]
struct TensorReport<'a> {
    name: &'a str,
    dtype: &'static str,
    shape: &'a [u64],
    bytes: u64,
    file: &'a str,
    /// `[begin, end)` relative to the data section, as in the header.
    data_offsets: [u64; 2],
}

#[derive(Serialize)]
struct Totals {
    files: usize,
    tensors: usize,
    bytes: u64,
}

#[derive(Serialize)]
struct Report<'a> {
    files: Vec<FileReport<'a>>,
    tensors: Vec<TensorReport<'a>>,
    total: Totals,
}

fn report(shards: &[Shard]) -> Report<'_> {
    let files = shards
        .iter()
        .map(|s| FileReport {
            file: &s.name,
            size: s.size,
            header_bytes: s.header.data_start,
            tensors: s.header.tensors.len(),
            bytes: s.header.data_len(),
            metadata: s.header.metadata.as_ref().unwrap_or(&EMPTY),
        })
        .collect();
    let tensors = shards
        .iter()
        .flat_map(|s| {
            s.header.tensors.iter().map(|t| TensorReport {
                name: &t.name,
                dtype: t.dtype.as_str(),
                shape: &t.shape,
                bytes: t.len(),
                file: &s.name,
                data_offsets: [t.begin, t.end],
            })
        })
        .collect::<Vec<_>>();
    let total = Totals {
        files: shards.len(),
        tensors: tensors.len(),
        bytes: tensors.iter().map(|t| t.bytes).sum(),
    };
    Report {
        files,
        tensors,
        total,
    }
}

fn short_name(file: &str) -> &str {
    Path::new(file)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(file)
}

fn render(r: &Report<'_>) -> String {
    let mut table = Table::new(&["name", "dtype", "shape", "bytes", "file"], &[0, 1, 2, 4]);
    for t in &r.tensors {
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        table.push(vec![
            t.name.to_string(),
            t.dtype.to_string(),
            format!("[{}]", shape.join(", ")),
            t.bytes.to_string(),
            short_name(t.file).to_string(),
        ]);
    }
    let mut out = table.render();
    out.push('\n');
    for f in &r.files {
        out.push_str(&format!(
            "file {}: {}, {} bytes of data ({}), {}-byte header\n",
            f.file,
            plural(f.tensors, "tensor"),
            f.bytes,
            decimal_bytes(f.bytes),
            f.header_bytes
        ));
    }
    out.push_str(&format!(
        "total: {}, {}, {} bytes ({})\n",
        plural(r.total.files, "file"),
        plural(r.total.tensors, "tensor"),
        r.total.bytes,
        decimal_bytes(r.total.bytes)
    ));
    out
}

/// The `--json` object of `shards`, on one line; `fastload.inspect` returns it parsed, so the
/// command line and the Python API have one shape.
pub(crate) fn to_json(shards: &[Shard]) -> String {
    serde_json::to_string(&report(shards)).expect("the report serializes")
}

pub(super) fn run(args: InspectArgs) -> CliResult {
    let shards = source::open::open_all(
        &args.uris,
        &[],
        &crate::source::cache::CacheSettings::off(),
        &source::decrypt::Decryption::for_load(&crate::options::LoadOptions {
            keyset: super::keyset_file(args.keyset.as_deref())?,
            ..Default::default()
        })?,
    )?;
    if args.json {
        print_stdout(&(to_json(&shards) + "\n"))
    } else {
        print_stdout(&render(&report(&shards)))
    }
}
