//! User-facing options: byte sizes like "64MiB", the FASTLOAD_* environment variables, and the
//! defaults each source gets when nothing is set.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A byte range `begin..end` within the data of tensor `name`: `(name, begin, end)`.
pub type Part = (String, u64, u64);

/// A byte count parsed from an integer or a string such as "8MiB", "1.5GiB" or "64MB".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Size(pub u64);

impl FromStr for Size {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => {
                return Err(format!(
                    "{s:?} has unknown unit {unit:?} (use B, KB, MB, GB, KiB, MiB, GiB or TiB)"
                ))
            }
        };
        if num.is_empty() {
            return Err(format!(
                "{s:?} is not a size (expected e.g. 8MiB or 1048576)"
            ));
        }
        if let Ok(n) = num.parse::<u64>() {
            return n
                .checked_mul(mult)
                .map(Size)
                .ok_or_else(|| format!("{s:?} is too large"));
        }
        let f: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (expected e.g. 8MiB or 1048576)"))?;
        let bytes = f * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(format!("{s:?} is out of range"));
        }
        Ok(Size(bytes.round() as u64))
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (name, unit) in UNITS {
            if self.0 >= unit && self.0 % unit == 0 {
                return write!(f, "{}{name}", self.0 / unit);
            }
        }
        write!(f, "{}B", self.0)
    }
}

/// How local files are read into host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Method {
    /// Pick per source: mmap for local files on a local filesystem, read for network and FUSE
    /// filesystems and objects (see `pipeline::auto_method`).
    #[default]
    Auto,
    /// Map windows of the file and fault them in from several threads: no copy out of the
    /// page cache at all.
    Mmap,
    /// `pread` into reused, pre-faulted anonymous buffers.
    Read,
    /// Blocks not in the page cache read around it (`O_DIRECT`) straight into aligned buffers;
    /// cached blocks, and files whose filesystem refuses `O_DIRECT`, read as [`Method::Read`].
    Direct,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Auto => "auto",
            Method::Mmap => "mmap",
            Method::Read => "read",
            Method::Direct => "direct",
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Method {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Method::Auto),
            "mmap" => Ok(Method::Mmap),
            "read" | "pread" => Ok(Method::Read),
            "direct" => Ok(Method::Direct),
            _ => Err(format!(
                "{s:?} is not a method (use auto, mmap, read or direct)"
            )),
        }
    }
}

/// Options of one load, as given by the caller; unset fields come from the environment, then
/// from defaults.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub concurrency: Option<usize>,
    pub block_size: Option<u64>,
    pub memory_limit: Option<u64>,
    pub names: Option<Vec<String>>,
    pub method: Method,
    /// Copy queues of a staged load (`None`: `FASTLOAD_COPY_STREAMS`, else one).
    pub copy_streams: Option<usize>,
    /// Object-store settings (`endpoint`, `region`, `access_key_id`, ...); override `AWS_*` etc.
    pub storage_options: Vec<(String, String)>,
    /// Byte ranges `(tensor, begin, end)` within tensors to read instead of whole tensors (how a
    /// rank of a distributed load reads only its share); excludes `names`.
    pub parts: Option<Vec<Part>>,
    /// The local cache of remote objects (`None`: `FASTLOAD_CACHE`, else off).
    pub cache: Option<CacheChoice>,
    /// Check every object's sha256 where its store gives one (Hub LFS files), wherever its bytes
    /// come from (`None`: `FASTLOAD_VERIFY`, else off).
    pub verify: Option<bool>,
    /// A Tink keyset (cleartext JSON, or the path of a file holding it) that the files are
    /// encrypted with (`None`: `FASTLOAD_KEYSET`, else the files are read as they are); see
    /// source/decrypt/.
    pub keyset: Option<Secret>,
    /// The associated data the files were encrypted with (`None`: empty).
    pub associated_data: Option<Secret<Vec<u8>>>,
    /// Serves holding the same objects (`host:port`, `https://host:port`), read in place of
    /// the origin (`None`: `FASTLOAD_PEERS`, else none); see source/peer.rs.
    pub peers: Option<Vec<String>>,
    /// The bearer token the peers take (`None`: `FASTLOAD_PEER_TOKEN`, else none).
    pub peer_token: Option<Secret>,
}

/// A value that never shows: `Debug` prints `<secret>`, and it is wiped when dropped (keysets).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret<T: zeroize::Zeroize = String>(pub zeroize::Zeroizing<T>);

impl<T: zeroize::Zeroize> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

/// Whether and where remote objects are cached on local disk (see source/cache/).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheChoice {
    Off,
    /// The default directory (`$XDG_CACHE_HOME/fastload`, else `~/.cache/fastload`).
    Default,
    Dir(std::path::PathBuf),
}

impl FromStr for CacheChoice {
    type Err = String;

    /// `FASTLOAD_CACHE`: `0`/`false`/`off`/`no`, `1`/`true`/`on`/`yes`, or a directory.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Ok(match t.to_ascii_lowercase().as_str() {
            "" | "0" | "false" | "off" | "no" => CacheChoice::Off,
            "1" | "true" | "on" | "yes" => CacheChoice::Default,
            _ => CacheChoice::Dir(t.into()),
        })
    }
}

impl LoadOptions {
    /// This load's cache choice (the caller's, else `FASTLOAD_CACHE`, else off) and whether to
    /// verify sha256s (the caller's, else `FASTLOAD_VERIFY`, else off); the cache's settings are
    /// built from them in source/cache/ (`CacheSettings::for_load`).
    pub fn cache_choice(&self) -> Result<(CacheChoice, bool)> {
        let choice = match &self.cache {
            Some(c) => c.clone(),
            None => env_value::<CacheChoice>(ENV_CACHE)?.unwrap_or(CacheChoice::Off),
        };
        let verify = match self.verify {
            Some(v) => v,
            None => env_value::<Flag>(ENV_VERIFY)?.is_some_and(|f| f.0),
        };
        Ok((choice, verify))
    }
}

/// Options with every value decided.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub concurrency: usize,
    pub block_size: u64,
    pub memory_limit: u64,
    pub method: Method,
    /// Why `method` is what it is (`stats()["method_reason"]`).
    pub method_reason: String,
    /// Copy queues of a staged load: blocks are copied on them in turn (see
    /// [`crate::device::Engine::lane`]).
    pub copy_streams: usize,
    /// The block size of a staged (GPU) load: `block_size` where the caller or
    /// `FASTLOAD_BLOCK_SIZE` chose it, else [`DEFAULT_STAGED_LOCAL_BLOCK_SIZE`] for local files
    /// (a smaller page-locked ring for a process's first load to pin; measured on an H100,
    /// docs/benchmarks.md) and `block_size` for object stores (fewer, larger requests).
    pub staged_block_size: u64,
}

pub use crate::arguments::{
    ENV_BLOCK_SIZE, ENV_CACHE, ENV_CONCURRENCY, ENV_COPY_STREAMS, ENV_KEYSET, ENV_MEMORY_LIMIT,
    ENV_METHOD, ENV_VERIFY,
};

/// A place that takes an option, besides `fastload.load`, `stream`, `Stream` and
/// `fastload.distributed`'s `load` and `stream`, which take every option.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taker {
    /// The native load: a field of [`LoadOptions`], a keyword of `_fastload.Stream` and
    /// `_fastload.resolve_options` (`src/python/stream.rs`, `src/python/options.rs`).
    Native,
    /// `_fastload.Reader` (`src/python/reader.rs`), the reads of `fastload.safe_open`.
    Reader,
    /// `fastload.safe_open`'s keywords: the reader's, and those of the loads behind a GPU
    /// `get_tensor` and behind `get_tensors`.
    SafeOpen,
    /// A key of the vLLM and SGLang loaders' `model_loader_extra_config`, passed on to the load.
    ExtraConfig,
}

impl Taker {
    pub fn as_str(self) -> &'static str {
        match self {
            Taker::Native => "native",
            Taker::Reader => "reader",
            Taker::SafeOpen => "safe_open",
            Taker::ExtraConfig => "extra_config",
        }
    }
}

/// One load option, as every list of the options shows it. [`OPTIONS`] is the only list:
/// Python's signatures (`help()`, `inspect.signature`) and the engines' extra-config keys are
/// built from it (`_fastload.OPTIONS`), and `tests/test_options.py` checks the lists that must
/// stay written out for type checkers and readers against it (the `.pyi`, `fastload.Options`,
/// README's table, [`LoadOptions`]' fields) and names the place that differs.
#[derive(Clone, Copy, Debug)]
pub struct OptionDef {
    pub name: &'static str,
    /// Its annotation in `fastload.Options`, as written there.
    pub python_type: &'static str,
    /// Its default in a Python signature; `None` means "not given" (then `env`, then `default`).
    pub signature_default: Option<&'static str>,
    /// What applies when it is neither given nor set in `env`, in README's words.
    pub default: &'static str,
    /// The environment variable read when it is not given.
    pub env: Option<&'static str>,
    /// What it does, in README's words (its options table).
    pub help: &'static str,
    pub takers: &'static [Taker],
}

impl OptionDef {
    pub fn takes(&self, taker: Taker) -> bool {
        self.takers.contains(&taker)
    }
}

use Taker::{ExtraConfig, Native, Reader, SafeOpen};

pub const DEVICE: OptionDef = OptionDef {
    name: "device",
    python_type: "Device",
    signature_default: Some("cpu"),
    default: r#"`"cpu"`"#,
    env: None,
    help: r#"`"cpu"`, `"cuda"`, `"cuda:N"` or a `torch.device`"#,
    // torch's, resolved in Python.
    takers: &[],
};
pub const CONCURRENCY: OptionDef = OptionDef {
    name: "concurrency",
    python_type: "int | None",
    signature_default: None,
    default: "16; 64 for object stores",
    env: Some(ENV_CONCURRENCY),
    help: "reads in flight",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const BLOCK_SIZE: OptionDef = OptionDef {
    name: "block_size",
    python_type: "Size | None",
    signature_default: None,
    default: "8 MiB",
    env: Some(ENV_BLOCK_SIZE),
    help: r#"bytes per read: int or `"8MiB"`, `"4MB"`, ..."#,
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const MEMORY_LIMIT: OptionDef = OptionDef {
    name: "memory_limit",
    python_type: "Size | None",
    signature_default: None,
    default: "1 GiB",
    env: Some(ENV_MEMORY_LIMIT),
    help: "memory the loader may hold at once for tensors it has not handed you yet: host \
           buffers, and for a GPU load both the page-locked ring and the device memory of \
           tensors not yet yielded, each within it (tensors you keep are yours)",
    takers: &[Native, SafeOpen, ExtraConfig],
};
pub const NAMES: OptionDef = OptionDef {
    name: "names",
    python_type: "Iterable[str] | None",
    signature_default: None,
    default: "all",
    env: None,
    help: "load only these tensors (an iterable of names, or one name as a str); nothing else \
           is read",
    takers: &[Native],
};
pub const PARTS: OptionDef = OptionDef {
    name: "parts",
    python_type: "Mapping[str, Index] | None",
    signature_default: None,
    default: "none (whole tensors)",
    env: None,
    help: "load only a part of these tensors: `{name: index}`, the index as torch takes it \
           with ints, slices (steps >= 1) and `...`; only the bytes each part needs are read; \
           see \"Parts of tensors\"",
    // Planned in Python (`fastload._parts`) into the native load's byte ranges.
    takers: &[],
};
pub const METHOD: OptionDef = OptionDef {
    name: "method",
    python_type: "str | None",
    signature_default: None,
    default: "`auto` (to CPU, `mmap` for local files on a local filesystem, else `read`; to a \
              GPU, `read`)",
    env: Some(ENV_METHOD),
    help: "local read strategy: `auto`, `mmap` (map the file's pages, no copy; to a GPU, the \
           pages lent to the device read-only where they are, see \"GPU\"), `read` \
           (pread into pooled, pre-faulted buffers; to a GPU, into the page-locked ring), \
           `direct` (blocks not in the page cache read around it, `O_DIRECT`, into the \
           buffers `read` uses; cached blocks as `read`)",
    takers: &[Native, SafeOpen],
};
pub const COPY_STREAMS: OptionDef = OptionDef {
    name: "copy_streams",
    python_type: "int | None",
    signature_default: None,
    default: "1",
    env: Some(ENV_COPY_STREAMS),
    help: "copy queues of a GPU load (CUDA streams, 1 to 16): blocks are copied to the device \
           on each in turn, so that more than one of its copy engines may run at once; CPU \
           loads copy nothing and ignore it",
    takers: &[Native, SafeOpen, ExtraConfig],
};
pub const STORAGE_OPTIONS: OptionDef = OptionDef {
    name: "storage_options",
    python_type: "Mapping[str, object] | None",
    signature_default: None,
    default: "none (the environment)",
    env: None,
    help: "object-store and Hub settings (`endpoint`, `region`, keys, `token`, ...) that \
           override the environment; values are converted with `str()`; see \"Object storage\" \
           and \"Hugging Face Hub\"",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const CACHE: OptionDef = OptionDef {
    name: "cache",
    python_type: "bool | str | os.PathLike[str] | None",
    signature_default: None,
    default: "off",
    env: Some(ENV_CACHE),
    help: "keep a local copy of remote objects, written while they stream: `True` (the default \
           directory), a directory, or `False`; see \"Local cache\"",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const VERIFY: OptionDef = OptionDef {
    name: "verify",
    python_type: "bool | None",
    signature_default: None,
    default: "`False`",
    env: Some(ENV_VERIFY),
    help: "`True`: check Hub files against their sha256 (LFS) or git blob id wherever their \
           bytes come from (network, Hugging Face cache, local cache), and S3, GCS and Azure \
           objects against the whole-object checksum their store keeps \
           (CRC64NVME/CRC32C/sha256/MD5), a file read in part whole before any byte of it is \
           served; see \"Checking content\"",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const KEYSET: OptionDef = OptionDef {
    name: "keyset",
    python_type: "str | os.PathLike[str] | None",
    signature_default: None,
    default: "none (files are read as they are)",
    env: Some(ENV_KEYSET),
    help: "a Tink cleartext JSON keyset (a path, or the JSON itself) whose streaming-AEAD key \
           the files are encrypted with; see \"Encrypted checkpoints\"",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const ASSOCIATED_DATA: OptionDef = OptionDef {
    name: "associated_data",
    python_type: "bytes | str | None",
    signature_default: None,
    default: "empty",
    env: None,
    help: "the associated data the files were encrypted with (with `keyset`)",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};

pub const PEERS: OptionDef = OptionDef {
    name: "peers",
    python_type: "Sequence[str] | str | None",
    signature_default: None,
    default: "none",
    env: Some("FASTLOAD_PEERS"),
    help: "serves (`fastload serve`) that hold the same files: `[\"host:port\", \
           \"https://host:port\"]` (the variable comma-separated); a file is read from the first \
           one listing its origin's version, the rest from the next or the origin when one \
           fails; see docs/peers.md",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};
pub const PEER_TOKEN: OptionDef = OptionDef {
    name: "peer_token",
    python_type: "str | None",
    signature_default: None,
    default: "none",
    env: Some("FASTLOAD_PEER_TOKEN"),
    help: "the bearer token the peers take (a secret: never shown)",
    takers: &[Native, Reader, SafeOpen, ExtraConfig],
};

/// Every load option, in the order signatures list them. Adding one: a row here, then what
/// `tests/test_options.py` (`test_option_list_*`) and `cargo test options` name.
pub const OPTIONS: &[OptionDef] = &[
    DEVICE,
    CONCURRENCY,
    BLOCK_SIZE,
    MEMORY_LIMIT,
    NAMES,
    PARTS,
    METHOD,
    COPY_STREAMS,
    STORAGE_OPTIONS,
    CACHE,
    VERIFY,
    KEYSET,
    ASSOCIATED_DATA,
    PEERS,
    PEER_TOKEN,
];

pub use crate::arguments::{
    argument, Accepts, Argument, FrontEnd, ARGUMENTS, MAX_PART_SIZE, MIN_PART_SIZE,
};

/// `value` of the argument `option` if its row accepts it; else an error naming `named` (the
/// argument, or the environment variable the value came from). The one check of these values,
/// for every front end and every command (a load's, a write's, a copy's).
pub fn check(option: &str, named: &str, value: u64) -> Result<u64> {
    let accepts = argument(option).map_or(Accepts::Any, |a| a.accepts);
    let problem = match accepts {
        Accepts::Count(min, max) if !(min..=max).contains(&value) => {
            format!("{value} is not in {min}..={max}")
        }
        Accepts::Bytes(min, u64::MAX) if value < min => {
            format!("{} is below the {} minimum", Size(value), Size(min))
        }
        Accepts::Bytes(min, max) if !(min..=max).contains(&value) => {
            format!(
                "{} is not between {} and {}",
                Size(value),
                Size(min),
                Size(max)
            )
        }
        _ => return Ok(value),
    };
    Err(Error::option(named, problem))
}

/// A yes/no environment value: `1`/`true`/`on`/`yes` or `0`/`false`/`off`/`no` (or empty).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flag(pub bool);

impl FromStr for Flag {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "false" | "off" | "no" => Ok(Flag(false)),
            "1" | "true" | "on" | "yes" => Ok(Flag(true)),
            _ => Err(format!("{s:?} is not a yes/no value (use 1 or 0)")),
        }
    }
}

/// Defaults: enough reads in flight to keep a virtual disk or NVMe queue busy, blocks big enough
/// that syscall overhead vanishes, and a host-memory window that still overlaps reads of the next
/// segments with the consumer's work on the current one.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Reads in flight when any URI is an object store. One S3 connection carries about 85–90 MB/s
/// and AWS advises about 15 requests in flight per 10 Gb/s, so 16 would cap a load near 1.4 GB/s
/// on NICs of 100 Gb/s and more; 64 ranges of 8 MiB are 512 MiB in flight, half the default
/// memory limit. On a local SeaweedFS a load at 64 ran 1.2x (direct) and 1.1x (+20 ms RTT) the
/// rate at 16 (benches/s3_bench.py).
pub const DEFAULT_REMOTE_CONCURRENCY: usize = 64;
pub const DEFAULT_BLOCK_SIZE: u64 = 8 << 20;
/// Staged (GPU) loads of local files, unless a block size is given: see [`Resolved::staged_block_size`].
pub const DEFAULT_STAGED_LOCAL_BLOCK_SIZE: u64 = 4 << 20;
pub const DEFAULT_MEMORY_LIMIT: u64 = 1 << 30;

// Defaults of writes (`save_file`, `save`, `fastload.copy`, `fastload copy`: `crate::sink`'s
// `WriteOptions` and `crate::copy`'s `CopyOptions`), beside the load's: every default has its
// home here. They differ from a load's on purpose (a write holds upload parts, not tensors; a
// copy's reads feed one upload part at a time), so a write's `concurrency`, `block_size` and
// `memory_limit` keep their own defaults rather than [`OPTIONS`]' rows, whose one default each
// is a load's; the values each takes are checked by one table for every front end
// ([`ARGUMENTS`]).

/// Bytes of upload parts in flight at once, by default (a write's `memory_limit`; a copy shares
/// it between the files it copies at once).
pub const DEFAULT_WRITE_MEMORY_LIMIT: u64 = 256 << 20;
/// Bytes per upload part, by default (`part_size`): large enough that per-request costs vanish,
/// small enough to spread a file over many parallel requests.
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;
/// Upload parts in flight at most, whatever the memory limit.
pub const MAX_PARTS_IN_FLIGHT: usize = 64;
/// A copy's reads in flight per file, by default (`concurrency` of a copy).
pub const DEFAULT_COPY_CONCURRENCY: usize = 8;
/// A copy's bytes per read, by default (`block_size` of a copy): with
/// [`DEFAULT_COPY_CONCURRENCY`] reads in flight, a window of one default upload part, so that on
/// a link shared by the reads the first block (the one the upload waits for) lands early and
/// uploading overlaps downloading (8 MiB blocks measured 1.49x the wire time against 1.21x with
/// 2 MiB on a 50 MiB/s mock Hub).
pub const DEFAULT_COPY_BLOCK_SIZE: u64 = 2 << 20;

fn env_value<T: FromStr<Err = String>>(var: &str) -> Result<Option<T>> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v.parse().map(Some).map_err(|e| Error::option(var, e)),
        _ => Ok(None),
    }
}

/// The value of `option`: the caller's, else the variable `var` parsed as `T`, else `default`;
/// with the name of where it came from, so that an error names what the user set.
fn chosen<N: Copy, T: FromStr<Err = String>>(
    given: Option<N>,
    option: &'static str,
    var: &'static str,
    default: N,
    from_env: impl Fn(T) -> N,
) -> Result<(N, &'static str)> {
    Ok(match given {
        Some(v) => (v, option),
        None => match env_value::<T>(var)? {
            Some(v) => (from_env(v), var),
            None => (default, option),
        },
    })
}

struct Count(usize);

impl FromStr for Count {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.trim()
            .parse()
            .map(Count)
            .map_err(|_| format!("{s:?} is not a positive integer"))
    }
}

impl LoadOptions {
    /// Fills unset values from `FASTLOAD_*` variables, then defaults, and checks them. `remote`:
    /// the load reads from an object store, which takes more requests in flight by default.
    pub fn resolve(&self, remote: bool) -> Result<Resolved> {
        let default_concurrency = if remote {
            DEFAULT_REMOTE_CONCURRENCY
        } else {
            DEFAULT_CONCURRENCY
        };
        // Each value with where it came from: a bad one names the option or the variable the
        // user set, not one for the other.
        let (concurrency, concurrency_from) = chosen(
            self.concurrency,
            CONCURRENCY.name,
            ENV_CONCURRENCY,
            default_concurrency,
            |c: Count| c.0,
        )?;
        let (block_size, block_size_from) = chosen(
            self.block_size,
            BLOCK_SIZE.name,
            ENV_BLOCK_SIZE,
            DEFAULT_BLOCK_SIZE,
            |s: Size| s.0,
        )?;
        let (memory_limit, memory_limit_from) = chosen(
            self.memory_limit,
            MEMORY_LIMIT.name,
            ENV_MEMORY_LIMIT,
            DEFAULT_MEMORY_LIMIT,
            |s: Size| s.0,
        )?;
        let (copy_streams, copy_streams_from) = chosen(
            self.copy_streams,
            COPY_STREAMS.name,
            ENV_COPY_STREAMS,
            1,
            |c: Count| c.0,
        )?;
        let (method, method_reason) = match self.method {
            Method::Auto => match env_value::<Method>(ENV_METHOD)? {
                Some(m) => (m, format!("{ENV_METHOD}={}", m.as_str())),
                None => (Method::Auto, String::new()),
            },
            m => (m, format!("method={:?} was asked for", m.as_str())),
        };
        check(CONCURRENCY.name, concurrency_from, concurrency as u64)?;
        check(BLOCK_SIZE.name, block_size_from, block_size)?;
        check(MEMORY_LIMIT.name, memory_limit_from, memory_limit)?;
        check(COPY_STREAMS.name, copy_streams_from, copy_streams as u64)?;
        let given = self.block_size.is_some() || block_size_from == ENV_BLOCK_SIZE;
        let staged_block_size = if given || remote {
            block_size
        } else {
            DEFAULT_STAGED_LOCAL_BLOCK_SIZE
        };
        Ok(Resolved {
            concurrency,
            block_size,
            memory_limit,
            method,
            method_reason,
            copy_streams,
            staged_block_size,
        })
    }
}

/// Why `endpoint` cannot be the base of a service's URLs (the Hub's `HF_ENDPOINT`, an object
/// store's `endpoint`), if it cannot: it must be an `http(s)://` URL with a host (`data:,x`,
/// `mailto:...` or `ftp://...` are not), without a query or fragment. Checked when options are
/// read, so that a bad one is a `ConfigError` naming its option rather than a failure (or an
/// HTTP library's panic) at the first request.
pub fn check_endpoint(endpoint: &str) -> std::result::Result<url::Url, String> {
    let url = url::Url::parse(endpoint.trim()).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "the scheme must be http:// or https://, not {}:",
            url.scheme()
        ));
    }
    if url.cannot_be_a_base() || url.host_str().is_none_or(str::is_empty) {
        return Err("not an http(s) URL with a host".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("an endpoint has no query or fragment".into());
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!("64MiB".parse::<Size>().unwrap(), Size(64 << 20));
        assert_eq!("8MB".parse::<Size>().unwrap(), Size(8_000_000));
        assert_eq!("1.5GiB".parse::<Size>().unwrap(), Size(3 << 29));
        assert_eq!(" 4096 ".parse::<Size>().unwrap(), Size(4096));
        assert_eq!("2 gib".parse::<Size>().unwrap(), Size(2 << 30));
        assert!("12XB".parse::<Size>().is_err());
        assert!("MiB".parse::<Size>().is_err());
        assert!("-1MiB".parse::<Size>().is_err());
        assert!("99999999999TiB".parse::<Size>().is_err());
        assert_eq!(Size(64 << 20).to_string(), "64MiB");
        assert_eq!(Size(1000).to_string(), "1000B");
    }

    #[test]
    fn rejects_bad_options() {
        let o = LoadOptions {
            concurrency: Some(0),
            ..Default::default()
        };
        assert!(matches!(
            o.resolve(false),
            Err(Error::InvalidOption { ref option, .. }) if option == "concurrency"
        ));
        let o = LoadOptions {
            block_size: Some(10),
            concurrency: Some(1),
            memory_limit: Some(1 << 30),
            ..Default::default()
        };
        assert!(matches!(
            o.resolve(false),
            Err(Error::InvalidOption { ref option, .. }) if option == "block_size"
        ));
    }

    /// `LoadOptions` holds the native options of [`OPTIONS`] (and `parts`, which
    /// `fastload.distributed` sets from its plan and no caller gives).
    #[test]
    fn load_options_fields_are_the_native_options() {
        // Written without `..`: a field added to LoadOptions fails to compile here until it is
        // listed, and then this test until OPTIONS has its row (and the row its row here).
        let LoadOptions {
            concurrency: _,
            block_size: _,
            memory_limit: _,
            names: _,
            method: _,
            copy_streams: _,
            storage_options: _,
            cache: _,
            verify: _,
            keyset: _,
            associated_data: _,
            parts: _,
            peers: _,
            peer_token: _,
        } = LoadOptions::default();
        let fields = [
            "concurrency",
            "block_size",
            "memory_limit",
            "names",
            "method",
            "copy_streams",
            "storage_options",
            "cache",
            "verify",
            "keyset",
            "associated_data",
            "peers",
            "peer_token",
        ];
        let native: Vec<&str> = OPTIONS
            .iter()
            .filter(|o| o.takes(Taker::Native))
            .map(|o| o.name)
            .collect();
        assert_eq!(
            native, fields,
            "src/options.rs: LoadOptions' fields and OPTIONS' rows taken by Taker::Native differ"
        );
    }

    #[test]
    fn option_table_is_consistent() {
        for (i, o) in OPTIONS.iter().enumerate() {
            assert!(
                OPTIONS[..i].iter().all(|p| p.name != o.name),
                "{} twice in OPTIONS",
                o.name
            );
            if let Some(env) = o.env {
                assert!(env.starts_with("FASTLOAD_"), "{}: {env}", o.name);
                assert!(OPTIONS[..i].iter().all(|p| p.env != o.env), "{env} twice");
            }
            // What safe_open reads with, it takes; what the engines pass on, the load takes.
            assert!(
                !o.takes(Taker::Reader) || o.takes(Taker::SafeOpen),
                "{}",
                o.name
            );
            assert!(
                !o.takes(Taker::ExtraConfig) || o.takes(Taker::Native),
                "{}",
                o.name
            );
            assert!(!o.help.is_empty() && !o.default.is_empty(), "{}", o.name);
            assert!(
                !o.help.contains('|') && !o.default.contains('|'),
                "{}",
                o.name
            );
        }
    }

    /// Every option has its row in the table of names, and messages name arguments per front end.
    #[test]
    fn every_option_has_its_names() {
        for o in OPTIONS {
            let a =
                argument(o.name).unwrap_or_else(|| panic!("{} has no row in ARGUMENTS", o.name));
            assert_eq!((a.python, a.env), (o.name, o.env), "{}", o.name);
        }
        for (i, a) in ARGUMENTS.iter().enumerate() {
            assert!(
                ARGUMENTS[..i].iter().all(|b| b.option != a.option),
                "{}",
                a.option
            );
            if let Some((flag, given)) = a.cli {
                assert!(
                    flag.starts_with("--") && given.starts_with(flag),
                    "{}",
                    a.option
                );
            }
        }
        let (py, cli) = (FrontEnd::Python, FrontEnd::Cli);
        assert_eq!(py.name("block_size"), "block_size");
        assert_eq!(cli.name("block_size"), "--block-size");
        assert_eq!(
            cli.name("storage_options[\"endpoint\"]"),
            "--option endpoint"
        );
        assert_eq!(cli.name(ENV_KEYSET), ENV_KEYSET);
        assert_eq!(py.given("overwrite"), "overwrite=True");
        assert_eq!(cli.given("overwrite"), "--overwrite");
        assert_eq!(py.given("keyset"), "keyset= (or set FASTLOAD_KEYSET)");
        assert_eq!(
            cli.given("keyset"),
            "--keyset FILE (or set FASTLOAD_KEYSET)"
        );
        assert_eq!(
            (
                py.name("encrypt"),
                py.without("encrypt"),
                cli.without("encrypt")
            ),
            ("keyset".into(), "keyset=".into(), "--encrypt".into())
        );
    }

    #[test]
    fn object_stores_default_to_more_reads_in_flight() {
        let explicit = LoadOptions {
            concurrency: Some(7),
            ..Default::default()
        };
        assert_eq!(explicit.resolve(true).unwrap().concurrency, 7);
        assert_eq!(explicit.resolve(false).unwrap().concurrency, 7);
        if std::env::var_os(ENV_CONCURRENCY).is_none() {
            let unset = LoadOptions::default();
            assert_eq!(
                unset.resolve(true).unwrap().concurrency,
                DEFAULT_REMOTE_CONCURRENCY
            );
            assert_eq!(
                unset.resolve(false).unwrap().concurrency,
                DEFAULT_CONCURRENCY
            );
        }
    }
}
