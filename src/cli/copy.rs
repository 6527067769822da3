//! `fastload copy SRC DST`: a file or a whole model folder from any store to any store, read once
//! in parallel ranged reads and written through the write path (see `crate::copy`), with
//! a progress bar on stderr when it is a terminal.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::{decimal_bytes, plural, CliResult};
use crate::copy::{self, CopyOptions, Event};
use crate::options::{Size, ENV_KEYSET};
use crate::sink::WriteOptions;

#[derive(Args)]
pub(super) struct CopyArgs {
    /// What to copy: a file or folder (path or file://), an object or prefix (s3://, gs://,
    /// az://), one http(s):// file, or a Hugging Face Hub repo or folder (hf://org/repo[@rev][/path])
    #[arg(value_name = "SRC")]
    src: String,
    /// Where to: a path or file://, or s3://, gs://, az://. A folder (a trailing /, or an
    /// existing local folder) receives a single file under its own name; a folder source's
    /// files go under DST with their relative paths
    #[arg(value_name = "DST")]
    dst: String,
    /// Copy every file again, replacing whatever is at the destination, and remove the earlier
    /// checkpoint files the copy does not replace (a sharded set and its index under one new
    /// `model.safetensors`), as `save` does; other files stay (without it a copy of the same
    /// source is skipped and any other file refused)
    #[arg(long)]
    overwrite: bool,
    /// Do not check Hub files' sha256 / git blob id while they stream
    #[arg(long)]
    no_verify: bool,
    // boilerplate: the read flags as `bench` declares them, with copy's own help and defaults
    /// Reads in flight per file [default: 8]
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// Bytes per read request, e.g. 8MiB [default: 2MiB]
    #[arg(long, value_name = "SIZE")]
    block_size: Option<Size>,
    /// Bytes of upload parts in flight (object stores), shared by the files copied at once,
    /// e.g. 256MiB [default: 256MiB]
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<Size>,
    /// Bytes per upload part (object stores), between 5MiB and 5GiB [default: 16MiB]
    #[arg(long, value_name = "SIZE")]
    part_size: Option<Size>,
    /// Encrypt every .safetensors file with the primary key of the Tink keyset of --keyset, else
    /// of FASTLOAD_KEYSET (its JSON or a path), as Tink's streaming AEAD with empty associated
    /// data; other files are copied as they are
    #[arg(long)]
    encrypt: bool,
    /// The keyset --encrypt encrypts with: a file holding a Tink cleartext JSON keyset (never
    /// printed) [default: $FASTLOAD_KEYSET]
    #[arg(long, value_name = "FILE", requires = "encrypt")]
    keyset: Option<String>,
    /// A storage option KEY=VALUE for both stores (as storage_options= in Python), repeatable
    #[arg(long = "option", value_name = "KEY=VALUE")]
    options: Vec<String>,
}

pub(super) fn run(args: CopyArgs) -> CliResult {
    let mut storage_options = Vec::new();
    for pair in &args.options {
        let (k, v) = pair.split_once('=').ok_or_else(|| {
            crate::Error::option("storage_options", format!("{pair:?} is not KEY=VALUE"))
        })?;
        storage_options.push((k.trim().to_string(), v.to_string()));
    }
    let encryption = if args.encrypt {
        Some(encryption(args.keyset.as_deref())?)
    } else {
        None
    };
    let bar = progress();
    let options = CopyOptions {
        write: WriteOptions {
            overwrite: args.overwrite,
            storage_options,
            memory_limit: args.memory_limit.map(|s| s.0),
            part_size: args.part_size.map(|s| s.0),
            metadata: Vec::new(),
            encryption,
        },
        concurrency: args
            .concurrency
            .unwrap_or(crate::options::DEFAULT_COPY_CONCURRENCY),
        block_size: args
            .block_size
            .map_or(crate::options::DEFAULT_COPY_BLOCK_SIZE, |s| s.0),
        verify: !args.no_verify,
        progress: bar.clone(),
        ..CopyOptions::default()
    };
    let report = copy::copy(&args.src, &args.dst, &options)?;
    eprintln!(
        "copied {} ({}), skipped {} already there",
        plural(report.copied.len(), "file"),
        decimal_bytes(report.bytes),
        plural(report.skipped.len(), "file"),
    );
    Ok(())
}

/// What `--encrypt` encrypts with: the keyset of `--keyset FILE`, else of `FASTLOAD_KEYSET`.
fn encryption(keyset: Option<&str>) -> CliResult<crate::sink::Encryption> {
    if let Some(file) = super::keyset_file(keyset)? {
        return Ok(crate::sink::Encryption::new(&file.0, None, "keyset")?);
    }
    let keyset = zeroize::Zeroizing::new(std::env::var(ENV_KEYSET).unwrap_or_default());
    if keyset.trim().is_empty() {
        return Err(crate::Error::option(
            "encrypt",
            format!(
                "no keyset to encrypt with: pass {}",
                crate::options::FrontEnd::Cli.given("keyset")
            ),
        )
        .into());
    }
    Ok(crate::sink::Encryption::new(&keyset, None, ENV_KEYSET)?)
}

/// A progress bar on stderr (bytes, rate) when stderr is a terminal; `None` otherwise.
pub(crate) fn progress() -> Option<Arc<dyn Fn(Event) + Send + Sync>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar: Arc<Mutex<Option<ProgressBar>>> = Arc::default();
    Some(Arc::new(move |event| {
        let mut slot = bar.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            Event::Start { files, bytes } => {
                let b = ProgressBar::new(bytes);
                b.set_style(
                    ProgressStyle::with_template(
                        "{msg} [{bar:30}] {decimal_bytes}/{decimal_total_bytes} \
                         {decimal_bytes_per_sec}",
                    )
                    .expect("valid progress template")
                    .progress_chars("=> "),
                );
                b.set_message(format!("copy {}", plural(files, "file")));
                *slot = Some(b);
            }
            Event::Bytes(n) => {
                if let Some(b) = slot.as_ref() {
                    b.inc(n)
                }
            }
            Event::Done {
                bytes,
                skipped: true,
                ..
            } => {
                if let Some(b) = slot.as_ref() {
                    b.inc(bytes)
                }
            }
            Event::Done { .. } => {}
        }
        if let Some(b) = slot.as_ref() {
            if b.position() >= b.length().unwrap_or(0) {
                b.finish_and_clear();
            }
        }
    }))
}
