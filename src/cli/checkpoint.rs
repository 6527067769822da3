//! The checkpoint `fastload bench` uses when given no URI: a deterministic llama-like bf16 file,
//! generated once into the cache directory and reused.
//!
//! Written to a hidden temporary name, synced, then renamed, so an interrupted run never leaves a
//! truncated file under the final name. Syncing also leaves the pages clean, which `--cold` needs:
//! `POSIX_FADV_DONTNEED` cannot drop dirty pages.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::{decimal_bytes, CliError, CliResult};
use crate::options::Size;

/// Bump when the layout or the bytes change, so old cache entries are not mistaken for new ones.
const GENERATOR_VERSION: u32 = 1;
/// Overrides the cache directory (used as is, without a `fastload/` suffix).
pub(super) const ENV_CACHE_DIR: &str = "FASTLOAD_CACHE_DIR";
/// Smallest checkpoint with one layer of the narrowest model.
const MIN_SIZE: u64 = 1 << 20;
const CHUNK: usize = 4 << 20;
/// Hidden sizes of real llama-family models, widest first.
const HIDDEN: [u64; 13] = [
    8192, 5120, 4096, 3072, 2048, 1536, 1024, 768, 512, 384, 256, 128, 64,
];

/// Shapes of a llama-2 style model (no grouped-query attention, untied lm_head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    hidden: u64,
    intermediate: u64,
    layers: u64,
    vocab: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    /// Small random bf16 values, as trained weights look.
    Random,
    /// 1.0, as RMSNorm weights start.
    Ones,
}

struct Spec {
    name: String,
    shape: Vec<u64>,
    fill: Fill,
}

impl Spec {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * 2
    }
}

impl Layout {
    fn per_layer(&self) -> u64 {
        let (h, i) = (self.hidden, self.intermediate);
        4 * h * h + 3 * h * i + 2 * h
    }

    fn params(&self) -> u64 {
        2 * self.vocab * self.hidden + self.hidden + self.layers * self.per_layer()
    }

    /// The widest model whose layer count is still typical for its width (hidden/128 layers,
    /// as in llama-2 7B: 4096/32), with the vocabulary absorbing the remainder so the data
    /// section lands within a few KiB under `bytes`.
    fn for_size(bytes: u64) -> Result<Layout, String> {
        if bytes < MIN_SIZE {
            return Err(format!(
                "{} is below the {} minimum of a generated checkpoint",
                Size(bytes),
                Size(MIN_SIZE)
            ));
        }
        let params = bytes / 2;
        for hidden in HIDDEN {
            let mut layout = Layout {
                hidden,
                intermediate: (hidden * 8 / 3).div_ceil(64) * 64,
                layers: 0,
                vocab: (32 * hidden).min(32_000),
            };
            let min_layers = (hidden / 128).max(1);
            let fixed = layout.params();
            if params < fixed + min_layers * layout.per_layer() {
                continue;
            }
            layout.layers = (params - fixed) / layout.per_layer();
            layout.vocab = (params - hidden - layout.layers * layout.per_layer()) / (2 * hidden);
            return Ok(layout);
        }
        unreachable!("the narrowest layout fits in MIN_SIZE")
    }

    fn tensors(&self) -> Vec<Spec> {
        let (h, i, v) = (self.hidden, self.intermediate, self.vocab);
        let spec = |name: String, shape: Vec<u64>, fill| Spec { name, shape, fill };
        let mut out = vec![spec(
            "model.embed_tokens.weight".into(),
            vec![v, h],
            Fill::Random,
        )];
        for l in 0..self.layers {
            let layer = [
                ("self_attn.q_proj", vec![h, h], Fill::Random),
                ("self_attn.k_proj", vec![h, h], Fill::Random),
                ("self_attn.v_proj", vec![h, h], Fill::Random),
                ("self_attn.o_proj", vec![h, h], Fill::Random),
                ("mlp.gate_proj", vec![i, h], Fill::Random),
                ("mlp.up_proj", vec![i, h], Fill::Random),
                ("mlp.down_proj", vec![h, i], Fill::Random),
                ("input_layernorm", vec![h], Fill::Ones),
                ("post_attention_layernorm", vec![h], Fill::Ones),
            ];
            for (name, shape, fill) in layer {
                out.push(spec(format!("model.layers.{l}.{name}.weight"), shape, fill));
            }
        }
        out.push(spec("model.norm.weight".into(), vec![h], Fill::Ones));
        out.push(spec("lm_head.weight".into(), vec![v, h], Fill::Random));
        out
    }
}

/// The 8-byte length prefix and the JSON header, padded with spaces so the data starts at a
/// multiple of 8 (as the reference writer does).
fn header(specs: &[Spec]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert(
        "__metadata__".into(),
        serde_json::json!({"format": "pt", "generator": "fastload bench"}),
    );
    let mut offset = 0u64;
    for s in specs {
        let end = offset + s.bytes();
        map.insert(
            s.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": s.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&map).expect("a JSON map serializes");
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

/// splitmix64: tiny, fast, and good enough for benchmark bytes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Four bf16 values with random sign and mantissa and exponents 2^-10..2^-3: finite, small,
    /// never NaN, so the file also works as a (meaningless) model.
    fn bf16x4(&mut self) -> u64 {
        let x = self.next();
        let exponent = ((x >> 7) & 0x0007_0007_0007_0007) + 0x0075_0075_0075_0075;
        (x & 0x807F_807F_807F_807F) | (exponent << 7)
    }
}

fn fill(buf: &mut [u8], fill: Fill, rng: &mut SplitMix) {
    match fill {
        Fill::Ones => {
            for pair in buf.chunks_mut(2) {
                pair.copy_from_slice(&0x3F80u16.to_le_bytes()[..pair.len()]);
            }
        }
        Fill::Random => {
            for word in buf.chunks_mut(8) {
                word.copy_from_slice(&rng.bf16x4().to_le_bytes()[..word.len()]);
            }
        }
    }
}

fn write_file(path: &Path, header: &[u8], specs: &[Spec], bar: &ProgressBar) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(header)?;
    let mut rng = SplitMix(0x5EED_FA57_10AD);
    let mut buf = vec![0u8; CHUNK];
    for spec in specs {
        let mut left = spec.bytes();
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            fill(&mut buf[..n], spec.fill, &mut rng);
            file.write_all(&buf[..n])?;
            bar.inc(n as u64);
            left -= n as u64;
        }
    }
    file.sync_all()
}

fn cache_dir() -> CliResult<PathBuf> {
    if let Some(dir) = std::env::var_os(ENV_CACHE_DIR).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    dirs::cache_dir()
        .map(|d| d.join("fastload"))
        .ok_or_else(|| {
            CliError::Unsupported(format!(
                "no cache directory for the generated checkpoint; set {ENV_CACHE_DIR}"
            ))
        })
}

/// Removes temporaries of `file_name` left by runs that were killed (their pid is gone).
fn remove_stale_temps(dir: &Path, file_name: &str) {
    let prefix = format!(".{file_name}.tmp.");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> CliError + '_ {
    move |source| CliError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The name of the generated checkpoint of about `size` bytes (in [`cache_dir`]).
fn file_name(size: u64) -> String {
    format!("llama-bf16-{}-v{GENERATOR_VERSION}.safetensors", Size(size))
}

/// Whether `name` is a checkpoint this generator (any version, any size) wrote, or a temporary
/// of one.
fn is_generated(name: &str) -> bool {
    let name = name.strip_prefix('.').unwrap_or(name);
    name.starts_with("llama-bf16-")
        && (name.ends_with(".safetensors") || name.contains(".safetensors.tmp."))
}

/// `fastload bench --clean`: removes every generated checkpoint (and temporary) from the cache
/// directory; what it removed, as printed.
pub(super) fn clean() -> CliResult<String> {
    let dir = cache_dir()?;
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(format!(
                "nothing to remove: {} does not exist\n",
                dir.display()
            ));
        }
        Err(e) => return Err(io_error(&dir)(e)),
    };
    let (mut out, mut freed, mut removed) = (String::new(), 0u64, 0usize);
    for entry in entries {
        let entry = entry.map_err(io_error(&dir))?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_str().unwrap_or_default();
        // A temporary of a run still generating stays (its pid is alive).
        let writing = name
            .rsplit_once(".tmp.")
            .is_some_and(|(_, pid)| Path::new("/proc").join(pid).exists());
        let generated = is_generated(name) && !writing;
        let meta = entry.metadata().map_err(io_error(&path))?;
        if !generated || !meta.is_file() {
            continue;
        }
        fs::remove_file(&path).map_err(io_error(&path))?;
        out.push_str(&format!(
            "removed {} ({})\n",
            path.display(),
            decimal_bytes(meta.len())
        ));
        (freed, removed) = (freed + meta.len(), removed + 1);
    }
    if removed == 0 {
        return Ok(format!(
            "nothing to remove: no generated checkpoint in {}\n",
            dir.display()
        ));
    }
    out.push_str(&format!("freed {}\n", decimal_bytes(freed)));
    Ok(out)
}

/// The path of the generated checkpoint of about `size` bytes, generating it first when the
/// cache does not hold it yet.
pub(super) fn ensure(size: u64) -> CliResult<PathBuf> {
    let layout = Layout::for_size(size).map_err(|m| crate::Error::option("size", m))?;
    let specs = layout.tensors();
    let header = header(&specs);
    let data: u64 = specs.iter().map(Spec::bytes).sum();
    let expected = header.len() as u64 + data;

    let dir = cache_dir()?;
    fs::create_dir_all(&dir).map_err(io_error(&dir))?;
    let file_name = file_name(size);
    let path = dir.join(&file_name);
    // Same name and same length: the generator is deterministic, so the bytes are the same too.
    if fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == expected) {
        eprintln!("fastload: using cached checkpoint {}", path.display());
        return Ok(path);
    }
    eprintln!(
        "fastload: generating a {} llama-like bf16 checkpoint (hidden {}, {} layers, vocab {}, {} tensors) at {}",
        decimal_bytes(expected),
        layout.hidden,
        layout.layers,
        layout.vocab,
        specs.len(),
        path.display()
    );
    remove_stale_temps(&dir, &file_name);
    let tmp = dir.join(format!(".{file_name}.tmp.{}", std::process::id()));
    let bar = ProgressBar::new(expected);
    bar.set_style(
        ProgressStyle::with_template(
            "generating [{bar:30}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec}",
        )
        .expect("valid progress template")
        .progress_chars("=> "),
    );
    bar.inc(header.len() as u64);
    let started = Instant::now();
    let written = write_file(&tmp, &header, &specs, &bar).and_then(|()| fs::rename(&tmp, &path));
    bar.finish_and_clear();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_error(&path)(e));
    }
    eprintln!(
        "fastload: generated in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_land_just_under_the_size() {
        for size in [1 << 20, 8 << 20, 100_000_000, 1 << 30, 7 << 30, 16 << 30] {
            let l = Layout::for_size(size).unwrap();
            let data = l.params() * 2;
            assert!(data <= size && size - data < 8 * l.hidden, "{size}: {l:?}");
            assert!(l.layers >= (l.hidden / 128).max(1), "{size}: {l:?}");
            assert!(l.vocab >= (32 * l.hidden).min(32_000), "{size}: {l:?}");
        }
        let l = Layout::for_size(1 << 30).unwrap();
        assert_eq!((l.hidden, l.layers), (1536, 15));
        assert!(Layout::for_size(1000).is_err());
    }

    #[test]
    fn header_is_valid_and_covers_the_data() {
        let specs = Layout::for_size(2 << 20).unwrap().tensors();
        let h = header(&specs);
        assert_eq!(h.len() % 8, 0);
        let data: u64 = specs.iter().map(Spec::bytes).sum();
        let parsed = crate::format::parse(&h, h.len() as u64 + data).unwrap();
        assert_eq!(parsed.tensors.len(), specs.len());
        assert_eq!(parsed.data_start, h.len() as u64);
        assert_eq!(parsed.metadata.unwrap()["format"], "pt");
    }

    #[test]
    fn clean_removes_the_generated_files_only() {
        assert_eq!(file_name(1 << 30), "llama-bf16-1GiB-v1.safetensors");
        assert!(is_generated(&file_name(1 << 20)));
        assert!(is_generated(".llama-bf16-1GiB-v1.safetensors.tmp.123"));
        assert!(!is_generated("model.safetensors") && !is_generated("llama-bf16-notes.txt"));
    }

    #[test]
    fn random_bf16_is_finite_and_small() {
        let mut rng = SplitMix(1);
        for _ in 0..10_000 {
            let x = rng.bf16x4();
            for lane in 0..4 {
                let bits = (x >> (16 * lane)) as u16;
                let value = f32::from_bits((bits as u32) << 16);
                assert!(value.is_finite() && value.abs() < 0.25 && value != 0.0);
            }
        }
    }
}
