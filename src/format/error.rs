//! Why a header or an index file was rejected.

use std::fmt;

use super::{Dtype, NameProblem};

/// Why a header or an index file was rejected; the caller adds the file name. The messages are
/// what users and the Python tests read: they are part of the interface.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("file is {file_size} bytes, too small to hold the 8-byte header length")]
    FileTooSmall { file_size: u64 },
    #[error("only {given} bytes given, too few to hold the 8-byte header length")]
    PrefixTooShort { given: usize },
    #[error("header length {len} is over the {limit}-byte limit")]
    HeaderTooLarge { len: u64, limit: u64 },
    #[error("header length {len} runs past the end of the file ({file_size} bytes)")]
    HeaderPastEnd { len: u64, file_size: u64 },
    #[error("header length {len} is too small for a JSON object")]
    HeaderTooSmall { len: u64 },
    /// The caller handed over fewer bytes than the header length asks for.
    #[error("header needs {needed} bytes but only {given} were given")]
    HeaderTruncated { needed: usize, given: usize },
    #[error("header is not valid UTF-8 ({source})")]
    InvalidUtf8 { source: std::str::Utf8Error },
    #[error("header does not start with '{{'")]
    NotAnObject,
    /// Malformed JSON, or JSON of the wrong shape, outside what the variants below name.
    #[error("header is not valid JSON: {reason}")]
    InvalidJson { reason: String },
    #[error("header is not valid JSON: duplicate __metadata__{at}")]
    DuplicateMetadata { at: JsonPosition },
    /// `__metadata__` is not a map of strings to strings.
    #[error("header is not valid JSON: __metadata__: {reason}{at}")]
    InvalidMetadata { reason: String, at: JsonPosition },
    #[error("header is not valid JSON: duplicate tensor name {name:?}{at}")]
    DuplicateTensor { name: String, at: JsonPosition },
    /// A tensor entry lacks a field or has one of the wrong type.
    #[error("header is not valid JSON: tensor {name:?}: {reason}{at}")]
    InvalidEntry {
        name: String,
        reason: String,
        at: JsonPosition,
    },
    #[error("tensor {name:?} has unknown dtype {dtype:?}")]
    UnknownDtype { name: String, dtype: String },
    #[error("tensor {name:?} has data_offsets [{begin}, {end}] that run backwards")]
    OffsetsBackwards { name: String, begin: u64, end: u64 },
    #[error("tensor {name:?} has data_offsets [{begin}, {end}] past the end of the data section ({data_len} bytes)")]
    OffsetsPastEnd {
        name: String,
        begin: u64,
        end: u64,
        data_len: u64,
    },
    #[error("tensor {name:?} shape {shape:?} overflows")]
    ShapeOverflow { name: String, shape: Vec<u64> },
    /// A dimension no tensor library can hold (above 2^63 - 1), even in an empty tensor.
    #[error("tensor {name:?} shape {shape:?} has a dimension above 2^63 - 1")]
    DimensionTooLarge { name: String, shape: Vec<u64> },
    /// A sub-byte dtype whose element count leaves a partial byte.
    #[error("tensor {name:?} of {dtype} with shape {shape:?} does not fill whole bytes")]
    PartialBytes {
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
    },
    /// The shape and dtype need `needed` bytes; the offsets hold `end - begin`.
    #[error("tensor {name:?} of {dtype} with shape {shape:?} needs {needed} bytes but data_offsets [{begin}, {end}] hold {}", end - begin)]
    OffsetsMismatch {
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
        needed: u64,
        begin: u64,
        end: u64,
    },
    #[error("tensor {name:?} at [{begin}, {end}] overlaps the previous tensor (which ends at {previous_end})")]
    Overlap {
        name: String,
        begin: u64,
        end: u64,
        previous_end: u64,
    },
    #[error("gap in the data section: bytes [{start}, {end}] before tensor {name:?} belong to no tensor")]
    Gap { name: String, start: u64, end: u64 },
    #[error("tensors cover {covered} bytes but the data section holds {data_len} (file is {file_size} bytes)")]
    Coverage {
        covered: u64,
        data_len: u64,
        file_size: u64,
    },
    #[error("is a directory, not a safetensors file")]
    IsDirectory,
    /// A FIFO, device or socket: refused before it is opened (opening a FIFO blocks until a
    /// writer comes, reading a device never ends).
    #[error("is a {kind}, not a regular file (only regular files are read)")]
    NotARegularFile { kind: &'static str },
    /// Two shards of one checkpoint hold a tensor of the same name.
    #[error("tensor {name:?} is also in {other} (tensor names must be unique across shards)")]
    DuplicateAcrossShards { name: String, other: String },
    /// An index over the cap on files read whole (`crate::bounded::MAX_WHOLE_READ`), found by its
    /// size or while it streamed in (never read past the cap).
    #[error("index file has more than {limit} bytes, the limit for a file read whole")]
    IndexTooLarge { limit: u64 },
    #[error("index is not valid JSON: {reason}")]
    IndexInvalidJson { reason: String },
    #[error("index has no \"weight_map\" object")]
    IndexNoWeightMap,
    #[error("weight_map entry for {tensor:?} is not a file name")]
    IndexEntryNotAName { tensor: String },
    /// An entry that does not name a file inside the index's folder ([`super::check_inside`]),
    /// refused before anything is read. Raised to Python as a `ConfigError`, as every
    /// integration that resolves an index refuses it.
    #[error("weight_map entry for {tensor:?} names {file:?}, which is not a file inside the checkpoint directory: {reason}")]
    IndexEntryOutside {
        tensor: String,
        file: String,
        reason: NameProblem,
    },
    /// A name the object store cannot use as a path.
    #[error("weight_map names an invalid file {file:?}: {reason}")]
    IndexInvalidPath { file: String, reason: String },
    /// Files of a `<stem>-<K>-of-<N>.safetensors` set without all `N` of them (a save that
    /// stopped part-way): the first few missing names, and how many are missing in all.
    #[error("checkpoint {set} is incomplete: {} missing (it loads only with all {n} files; a save that stopped part-way leaves such a set)", super::shards::missing_text(missing, *count))]
    ShardsMissing {
        set: String,
        n: u64,
        missing: Vec<String>,
        count: u64,
    },
    /// A folder without an index holding a stem's single file beside a `K-of-N` set of it, or
    /// sets of different `N` (an older save's files beside a newer one's).
    #[error("{}", super::shards::mixed_text(single, sets))]
    CheckpointsMixed {
        single: Option<String>,
        /// Each set's pattern (`model-0000K-of-00003.safetensors`) and files present.
        sets: Vec<(String, usize)>,
    },
}

/// Where serde_json stopped in a header, shown as serde_json shows it (" at line 1 column 40";
/// nothing for line 0, which serde_json uses for "no position").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonPosition {
    pub line: usize,
    pub column: usize,
}

impl JsonPosition {
    pub(super) fn of(e: &serde_json::Error) -> Self {
        JsonPosition {
            line: e.line(),
            column: e.column(),
        }
    }
}

impl fmt::Display for JsonPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            return Ok(());
        }
        write!(f, " at line {} column {}", self.line, self.column)
    }
}
