//! The checkpoint format: the safetensors header (bytes in, validated tensor entries out), the
//! index file of sharded checkpoints ([`index_shard_names`]) and which files make a whole
//! checkpoint ([`check_folder`], [`check_complete`]).
//!
//! Pure and allocation-bounded: nothing here trusts a length before checking it against the
//! file size, every size computation is checked, and the tensors must tile the data section
//! exactly (no overlaps, no gaps, nothing past the end). Fuzzed by `fuzz/fuzz_targets/header.rs`.

use std::collections::BTreeMap;
use std::fmt;

mod error;
mod index;
mod json;
mod names;
mod shards;

pub use error::{FormatError, JsonPosition};
pub use index::{index_json, index_shard_names, INDEX_FILE};
use json::{parse_json, RawInfo};
pub use names::{check_inside, NameProblem};
pub use shards::{check_complete, check_folder};

/// Bytes of the little-endian header-length prefix.
pub const PREFIX_LEN: u64 = 8;
/// Largest header accepted, as in the reference implementation.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Element types of the safetensors format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E5M2Fnuz,
    F8E4M3Fnuz,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E5M2Fnuz,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The name used in safetensors headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    pub fn parse(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.as_str() == name)
    }

    /// Bits per element (sub-byte types pack several elements per byte).
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 8,
            Dtype::F8E5M2 | Dtype::F8E4M3 | Dtype::F8E8M0 => 8,
            Dtype::F8E5M2Fnuz | Dtype::F8E4M3Fnuz => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tensor of a file. `begin..end` is relative to the start of the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub begin: u64,
    pub end: u64,
}

impl TensorEntry {
    pub fn len(&self) -> u64 {
        self.end - self.begin
    }

    pub fn is_empty(&self) -> bool {
        self.begin == self.end
    }
}

/// A validated header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Absolute file offset of the data section (8 + header length).
    pub data_start: u64,
    /// Tensors sorted by offset; together they cover the data section exactly.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` string map: `None` when the header has none (or `null`), which the
    /// reference keeps apart from an empty map (`safe_open(...).metadata()` is `None` or `{}`).
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Header {
    /// Bytes of tensor data (the file size minus the header).
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end)
    }
}

/// Reads the length prefix and checks it against the cap and the file size.
pub fn header_len(prefix: &[u8], file_size: u64) -> Result<u64, FormatError> {
    if file_size < PREFIX_LEN {
        return Err(FormatError::FileTooSmall { file_size });
    }
    if prefix.len() < PREFIX_LEN as usize {
        return Err(FormatError::PrefixTooShort {
            given: prefix.len(),
        });
    }
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&prefix[..8]);
    let len = u64::from_le_bytes(raw);
    if len > MAX_HEADER_LEN {
        return Err(FormatError::HeaderTooLarge {
            len,
            limit: MAX_HEADER_LEN,
        });
    }
    if len > file_size - PREFIX_LEN {
        return Err(FormatError::HeaderPastEnd { len, file_size });
    }
    if len < 2 {
        return Err(FormatError::HeaderTooSmall { len });
    }
    Ok(len)
}

/// Parses and validates the JSON header (the `n` bytes after the prefix) of a file of
/// `file_size` bytes.
pub fn parse_header(json: &[u8], file_size: u64) -> Result<Header, FormatError> {
    let len = json.len() as u64;
    let data_start = PREFIX_LEN
        .checked_add(len)
        .filter(|&s| s <= file_size)
        .ok_or(FormatError::HeaderPastEnd { len, file_size })?;
    let text = std::str::from_utf8(json).map_err(|source| FormatError::InvalidUtf8 { source })?;
    if !text.starts_with('{') {
        return Err(FormatError::NotAnObject);
    }
    let raw = parse_json(text)?;
    let data_len = file_size - data_start;

    let mut tensors = Vec::with_capacity(raw.tensors.len());
    for (name, info) in raw.tensors {
        tensors.push(check_entry(name, info, data_len)?);
    }
    tensors.sort_by_key(|t| (t.begin, t.end));

    let mut cursor = 0u64;
    for t in &tensors {
        if t.begin < cursor {
            return Err(FormatError::Overlap {
                name: t.name.clone(),
                begin: t.begin,
                end: t.end,
                previous_end: cursor,
            });
        }
        if t.begin > cursor {
            return Err(FormatError::Gap {
                name: t.name.clone(),
                start: cursor,
                end: t.begin,
            });
        }
        cursor = t.end;
    }
    if cursor != data_len {
        return Err(FormatError::Coverage {
            covered: cursor,
            data_len,
            file_size,
        });
    }
    Ok(Header {
        data_start,
        tensors,
        metadata: raw.metadata,
    })
}

/// One entry on its own: a known dtype, offsets inside the data section, and a shape whose byte
/// count (checked arithmetic) is what the offsets hold.
fn check_entry(name: String, info: RawInfo, data_len: u64) -> Result<TensorEntry, FormatError> {
    let Some(dtype) = Dtype::parse(&info.dtype) else {
        return Err(FormatError::UnknownDtype {
            name,
            dtype: info.dtype,
        });
    };
    let [begin, end] = info.data_offsets;
    if begin > end {
        return Err(FormatError::OffsetsBackwards { name, begin, end });
    }
    if end > data_len {
        return Err(FormatError::OffsetsPastEnd {
            name,
            begin,
            end,
            data_len,
        });
    }
    let shape = info.shape;
    // Frameworks hold dimensions as i64; a zero-element shape passes the byte count whatever its
    // other dimensions are.
    if shape.iter().any(|&d| d > i64::MAX as u64) {
        return Err(FormatError::DimensionTooLarge { name, shape });
    }
    let Some(bits) = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|elems| elems.checked_mul(dtype.bits()))
    else {
        return Err(FormatError::ShapeOverflow { name, shape });
    };
    if bits % 8 != 0 {
        return Err(FormatError::PartialBytes { name, dtype, shape });
    }
    if bits / 8 != end - begin {
        return Err(FormatError::OffsetsMismatch {
            name,
            dtype,
            shape,
            needed: bits / 8,
            begin,
            end,
        });
    }
    Ok(TensorEntry {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parses a header from the first bytes of a file (`bytes` holds at least the prefix and the
/// JSON, and may hold more). The entry point for the fuzzer.
pub fn parse(bytes: &[u8], file_size: u64) -> Result<Header, FormatError> {
    let n = header_len(bytes, file_size)?;
    let end = (PREFIX_LEN + n) as usize;
    if bytes.len() < end {
        return Err(FormatError::HeaderTruncated {
            needed: end,
            given: bytes.len(),
        });
    }
    parse_header(&bytes[PREFIX_LEN as usize..end], file_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data_len: u64) -> (Vec<u8>, u64) {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        let size = v.len() as u64 + data_len;
        (v, size)
    }

    fn err(json: &str, data_len: u64) -> FormatError {
        let (b, size) = file(json, data_len);
        parse(&b, size).unwrap_err()
    }

    fn ok(json: &str, data_len: u64) -> Header {
        let (b, size) = file(json, data_len);
        parse(&b, size).unwrap()
    }

    /// Asserts that the header `json` followed by `data_len` bytes of data is refused with an
    /// error that matches the pattern (and its guard).
    macro_rules! rejects {
        ($json:expr, $data_len:expr => $($pattern:tt)+) => {{
            let json = $json;
            let e = err(&json, $data_len);
            assert!(matches!(e, $($pattern)+), "{json}: {e}");
        }};
    }

    #[test]
    fn parses_a_valid_header() {
        let (b, size) = file(
            r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"a":{"dtype":"I32","shape":[],"data_offsets":[0,4]}}  "#,
            12,
        );
        let h = parse(&b, size).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[1].shape, vec![2]);
        assert_eq!(h.data_start, b.len() as u64);
        assert_eq!(h.metadata.as_ref().unwrap()["format"], "pt");
    }

    #[test]
    fn rejects_gaps_overlaps_and_short_data() {
        let gap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#;
        rejects!(gap, 5 => FormatError::Gap { start: 2, end: 3, .. });
        let overlap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        rejects!(overlap, 3 => FormatError::Overlap { begin: 1, previous_end: 2, .. });
        let short = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        rejects!(short, 3 => FormatError::OffsetsPastEnd { data_len: 3, .. });
    }

    #[test]
    fn rejects_bad_lengths_without_allocating() {
        let mut b = u64::MAX.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(matches!(
            parse(&b, 10),
            Err(FormatError::HeaderTooLarge { len: u64::MAX, .. })
        ));
        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(matches!(
            parse(&b, 10),
            Err(FormatError::HeaderPastEnd {
                len: 1000,
                file_size: 10
            })
        ));
        assert!(matches!(
            parse(b"abc", 3),
            Err(FormatError::FileTooSmall { file_size: 3 })
        ));
    }

    #[test]
    fn rejects_overflowing_shapes_and_bad_dtypes() {
        let big =
            r#"{"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#;
        rejects!(big, 0 => FormatError::ShapeOverflow { .. });
        let empty_but_huge =
            r#"{"a":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}}"#;
        rejects!(empty_but_huge, 0 => FormatError::DimensionTooLarge { .. });
        let largest =
            r#"{"a":{"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,0]}}"#;
        let (b, size) = file(largest, 0);
        assert!(parse(&b, size).is_ok());
        let bad = r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#;
        rejects!(bad, 16 => FormatError::UnknownDtype { ref dtype, .. } if dtype == "F128");
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        rejects!(dup, 2 => FormatError::DuplicateTensor { ref name, .. } if name == "a");
    }

    fn raw_file(json: &[u8], data_len: u64) -> (Vec<u8>, u64) {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json);
        let size = v.len() as u64 + data_len;
        (v, size)
    }

    /// The messages are what users and the Python tests read: pinned here word for word.
    #[test]
    fn messages_are_stable() {
        let name = || "w".to_string();
        let cases = [
            (
                FormatError::FileTooSmall { file_size: 3 },
                "file is 3 bytes, too small to hold the 8-byte header length",
            ),
            (
                FormatError::PrefixTooShort { given: 3 },
                "only 3 bytes given, too few to hold the 8-byte header length",
            ),
            (
                FormatError::HeaderTooLarge {
                    len: 100_000_001,
                    limit: MAX_HEADER_LEN,
                },
                "header length 100000001 is over the 100000000-byte limit",
            ),
            (
                FormatError::HeaderPastEnd {
                    len: 9,
                    file_size: 10,
                },
                "header length 9 runs past the end of the file (10 bytes)",
            ),
            (
                FormatError::HeaderTooSmall { len: 1 },
                "header length 1 is too small for a JSON object",
            ),
            (
                FormatError::HeaderTruncated {
                    needed: 10,
                    given: 9,
                },
                "header needs 10 bytes but only 9 were given",
            ),
            (FormatError::NotAnObject, "header does not start with '{'"),
            (
                FormatError::UnknownDtype {
                    name: name(),
                    dtype: "F128".into(),
                },
                "tensor \"w\" has unknown dtype \"F128\"",
            ),
            (
                FormatError::OffsetsBackwards {
                    name: name(),
                    begin: 4,
                    end: 0,
                },
                "tensor \"w\" has data_offsets [4, 0] that run backwards",
            ),
            (
                FormatError::OffsetsPastEnd {
                    name: name(),
                    begin: 0,
                    end: 4,
                    data_len: 2,
                },
                "tensor \"w\" has data_offsets [0, 4] past the end of the data section (2 bytes)",
            ),
            (
                FormatError::ShapeOverflow {
                    name: name(),
                    shape: vec![u64::MAX, 2],
                },
                "tensor \"w\" shape [18446744073709551615, 2] overflows",
            ),
            (
                FormatError::PartialBytes {
                    name: name(),
                    dtype: Dtype::F4,
                    shape: vec![3],
                },
                "tensor \"w\" of F4 with shape [3] does not fill whole bytes",
            ),
            (
                FormatError::OffsetsMismatch {
                    name: name(),
                    dtype: Dtype::F32,
                    shape: vec![2],
                    needed: 8,
                    begin: 4,
                    end: 8,
                },
                "tensor \"w\" of F32 with shape [2] needs 8 bytes but data_offsets [4, 8] hold 4",
            ),
            (
                FormatError::Overlap {
                    name: name(),
                    begin: 1,
                    end: 3,
                    previous_end: 2,
                },
                "tensor \"w\" at [1, 3] overlaps the previous tensor (which ends at 2)",
            ),
            (
                FormatError::Gap {
                    name: name(),
                    start: 2,
                    end: 3,
                },
                "gap in the data section: bytes [2, 3] before tensor \"w\" belong to no tensor",
            ),
            (
                FormatError::Coverage {
                    covered: 4,
                    data_len: 5,
                    file_size: 70,
                },
                "tensors cover 4 bytes but the data section holds 5 (file is 70 bytes)",
            ),
            (
                FormatError::IsDirectory,
                "is a directory, not a safetensors file",
            ),
            (
                FormatError::DuplicateAcrossShards {
                    name: name(),
                    other: "a.safetensors".into(),
                },
                "tensor \"w\" is also in a.safetensors (tensor names must be unique across shards)",
            ),
            (
                FormatError::IndexTooLarge { limit: 100 },
                "index file has more than 100 bytes, the limit for a file read whole",
            ),
            (
                FormatError::IndexNoWeightMap,
                "index has no \"weight_map\" object",
            ),
            (
                FormatError::IndexEntryNotAName { tensor: name() },
                "weight_map entry for \"w\" is not a file name",
            ),
            (
                FormatError::IndexEntryOutside {
                    tensor: name(),
                    file: "../x".into(),
                    reason: NameProblem::Parent,
                },
                "weight_map entry for \"w\" names \"../x\", which is not a file inside the checkpoint directory: it climbs out with '..'",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
        // JSON errors keep serde_json's wording and position, as they always read.
        let parsed = [
            (
                r#"{"w":{"dtype":"U8","shape":[1]}}"#,
                "header is not valid JSON: tensor \"w\": missing field `data_offsets` at line 1 column 31",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{}}"#,
                "header is not valid JSON: duplicate tensor name \"a\" at line 1 column 56",
            ),
            (
                r#"{"__metadata__":{},"__metadata__":{}}"#,
                "header is not valid JSON: duplicate __metadata__ at line 1 column 33",
            ),
            (
                r#"{"__metadata__":{"a":1}}"#,
                "header is not valid JSON: __metadata__: invalid type: integer `1`, expected a string at line 1 column 22",
            ),
            ("{ ", "header is not valid JSON: EOF while parsing an object at line 1 column 2"),
        ];
        for (json, text) in parsed {
            assert_eq!(err(json, 0).to_string(), text, "{json}");
        }
    }

    #[test]
    fn rejects_invalid_utf8() {
        let (b, size) = raw_file(
            b"{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}",
            1,
        );
        assert!(matches!(
            parse(&b, size),
            Err(FormatError::InvalidUtf8 { .. })
        ));
        // A multi-byte sequence cut off by the header length.
        let (b, size) = raw_file("{\"é\":1}".as_bytes().split_at(3).0, 0);
        assert!(matches!(
            parse(&b, size),
            Err(FormatError::InvalidUtf8 { .. })
        ));
    }

    #[test]
    fn rejects_invalid_json() {
        for json in [
            "{ ",
            "{\"a\":}",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} trailing",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}\0\0",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}",
            "{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}",
            "{\"a\":null}",
            "{\"a\":[]}",
        ] {
            rejects!(json, 1 => FormatError::InvalidJson { .. } | FormatError::InvalidEntry { .. });
        }
        // The error names the offending tensor.
        rejects!("{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1 =>
            FormatError::InvalidEntry { ref name, ref reason, .. }
                if name == "w" && reason == "missing field `data_offsets`");
    }

    #[test]
    fn rejects_json_that_is_not_an_object() {
        for json in [
            "[]", "[1,2]", "\"{}\"", "123", "null", "true", " {}", "\n{}",
        ] {
            let e = err(json, 0);
            assert_eq!(e, FormatError::NotAnObject, "{json}");
        }
    }

    #[test]
    fn deep_nesting_neither_overflows_the_stack_nor_panics() {
        // serde_json skips unknown values without recursing: deep nesting there is valid JSON.
        let deep = format!(
            "{{\"a\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":{}{}}}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(ok(&deep, 1).tensors.len(), 1);
        // Unbalanced, it is an error.
        let unbalanced = format!("{{\"a\":{{\"x\":{}}}}}", "[".repeat(100_000));
        rejects!(&unbalanced, 1 => FormatError::InvalidEntry { ref name, .. } if name == "a");
        let deep_meta = format!(
            "{{\"__metadata__\":{}{}}}",
            "{\"k\":".repeat(50_000),
            "}".repeat(50_000)
        );
        rejects!(&deep_meta, 0 => FormatError::InvalidMetadata { .. });
    }

    #[test]
    fn unknown_fields_in_an_entry_are_ignored() {
        let h = ok(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"x":[1]}}}"#,
            1,
        );
        assert_eq!(h.tensors[0].end, 1);
    }

    #[test]
    fn rejects_unknown_dtypes() {
        for dtype in ["F128", "f32", "", "FLOAT", "F8", "Q4_0", "F32 "] {
            let json = format!(r#"{{"a":{{"dtype":"{dtype}","shape":[1],"data_offsets":[0,4]}}}}"#);
            rejects!(json, 4 => FormatError::UnknownDtype { dtype: ref d, .. } if d == dtype);
        }
    }

    #[test]
    fn knows_every_dtype_by_its_header_name() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::parse(d.as_str()), Some(d));
            assert_eq!(d.to_string(), d.as_str());
        }
    }

    #[test]
    fn rejects_overflowing_shapes() {
        for shape in [
            "[9223372036854775807,4]",
            "[4294967296,4294967296]",
            "[1,1,1,9223372036854775807]",
            // Product fits in u64 but the bit count does not.
            "[2305843009213693952]",
        ] {
            let json = format!(r#"{{"a":{{"dtype":"F64","shape":{shape},"data_offsets":[0,8]}}}}"#);
            rejects!(json, 8 => FormatError::ShapeOverflow { ref name, .. } if name == "a");
        }
        // A zero dimension makes the product zero even beside huge ones: no overflow, 0 bytes
        // (up to 2^63 - 1; above it, no framework could hold the dimension).
        let h = ok(
            r#"{"a":{"dtype":"F64","shape":[0,9223372036854775807],"data_offsets":[0,0]}}"#,
            0,
        );
        assert_eq!(h.tensors[0].len(), 0);
        rejects!(r#"{"a":{"dtype":"F64","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#, 0 =>
            FormatError::DimensionTooLarge { .. });
    }

    #[test]
    fn rejects_sizes_that_disagree_with_the_shape() {
        rejects!(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4 =>
            FormatError::OffsetsMismatch { needed: 8, begin: 0, end: 4, .. });
        rejects!(r#"{"a":{"dtype":"F32","shape":[],"data_offsets":[0,8]}}"#, 8 =>
            FormatError::OffsetsMismatch { needed: 4, end: 8, .. });
    }

    #[test]
    fn rejects_offsets_out_of_range() {
        // End past the data section.
        rejects!(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 2 =>
            FormatError::OffsetsPastEnd { end: 4, data_len: 2, .. });
        // Offsets near u64::MAX with a consistent length must not overflow anything.
        rejects!(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#, 1 =>
            FormatError::OffsetsPastEnd { .. });
        // Backwards offsets.
        rejects!(r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#, 4 =>
            FormatError::OffsetsBackwards { begin: 4, end: 0, .. });
    }

    #[test]
    fn rejects_overlapping_tensors() {
        // Identical ranges.
        rejects!(r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#, 2 =>
            FormatError::Overlap { .. });
        // One inside another.
        rejects!(r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#, 8 =>
            FormatError::Overlap { .. });
        // An empty tensor in the middle of another one.
        rejects!(r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}"#, 8 =>
            FormatError::Overlap { .. });
    }

    #[test]
    fn rejects_gaps() {
        // Gap at the start.
        rejects!(r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#, 4 =>
            FormatError::Gap { start: 0, end: 2, .. });
        // An empty tensor after a gap; the data is long enough for the offsets.
        rejects!(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}}"#, 12 =>
            FormatError::Gap { ref name, start: 4, end: 9 } if name == "b");
        // The same empty tensor past the end of the data.
        rejects!(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}}"#, 4 =>
            FormatError::OffsetsPastEnd { begin: 9, end: 9, data_len: 4, .. });
    }

    #[test]
    fn rejects_data_longer_than_the_tensors() {
        rejects!(r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, 5 =>
            FormatError::Coverage { covered: 4, data_len: 5, .. });
        rejects!("{}", 1 => FormatError::Coverage { covered: 0, data_len: 1, .. });
    }

    #[test]
    fn accepts_empty_headers_and_files_without_tensors() {
        let h = ok("{}", 0);
        assert!(h.tensors.is_empty());
        assert_eq!(h.data_len(), 0);
        let h = ok("{}      ", 0);
        assert_eq!(h.data_start, 16);
        let h = ok(r#"{"__metadata__":{"format":"pt"}}"#, 0);
        assert_eq!(h.metadata.map(|m| m.len()), Some(1));
    }

    #[test]
    fn header_length_checks() {
        // Past the end of the file, by one byte.
        let (b, size) = file("{}", 0);
        assert!(matches!(
            parse(&b, size - 1),
            Err(FormatError::HeaderPastEnd { len: 2, .. })
        ));
        // Exactly the limit is allowed as far as the limit goes (then runs past the end here).
        let mut b = MAX_HEADER_LEN.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(matches!(
            parse(&b, 100),
            Err(FormatError::HeaderPastEnd {
                len: MAX_HEADER_LEN,
                file_size: 100
            })
        ));
        // One over the limit is refused even if the file is big enough.
        let mut b = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let e = parse(&b, u64::MAX).unwrap_err();
        assert_eq!(
            e,
            FormatError::HeaderTooLarge {
                len: MAX_HEADER_LEN + 1,
                limit: MAX_HEADER_LEN
            }
        );
        // 2**63 and u64::MAX: refused on the limit, no arithmetic overflow.
        for n in [1u64 << 63, u64::MAX, u64::MAX - 7] {
            let e = header_len(&n.to_le_bytes(), u64::MAX).unwrap_err();
            assert!(
                matches!(e, FormatError::HeaderTooLarge { len, .. } if len == n),
                "{n}: {e}"
            );
        }
        // Lengths too small for "{}".
        for n in [0u64, 1] {
            let mut b = n.to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            assert_eq!(
                parse(&b, 10).unwrap_err(),
                FormatError::HeaderTooSmall { len: n }
            );
        }
        // Files and prefixes shorter than 8 bytes.
        for size in 0..8u64 {
            let b = vec![0u8; size as usize];
            assert_eq!(
                parse(&b, size).unwrap_err(),
                FormatError::FileTooSmall { file_size: size }
            );
        }
        assert_eq!(
            header_len(&[2, 0, 0], 100),
            Err(FormatError::PrefixTooShort { given: 3 })
        );
        // The caller handed over fewer bytes than the header needs.
        let (b, size) = file("{}", 0);
        assert_eq!(
            parse(&b[..9], size),
            Err(FormatError::HeaderTruncated {
                needed: 10,
                given: 9
            })
        );
        assert_eq!(header_len(&b, size), Ok(2));
    }

    #[test]
    fn parse_header_checks_its_length_against_the_file() {
        assert_eq!(
            parse_header(b"{}", 9),
            Err(FormatError::HeaderPastEnd {
                len: 2,
                file_size: 9
            })
        );
        assert!(matches!(
            parse_header(b"{}", u64::MAX),
            Err(FormatError::Coverage { covered: 0, .. })
        ));
        assert_eq!(parse_header(b"{}", 10).unwrap().data_start, 10);
    }

    #[test]
    fn rejects_duplicates() {
        rejects!(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#, 2 =>
            FormatError::DuplicateTensor { ref name, .. } if name == "a");
        rejects!(r#"{"__metadata__":{},"__metadata__":{}}"#, 0 =>
            FormatError::DuplicateMetadata { .. });
    }

    #[test]
    fn metadata_must_map_strings_to_strings() {
        for meta in [
            r#"{"a":1}"#,
            r#"{"a":null}"#,
            r#"{"a":["x"]}"#,
            r#"{"a":{"b":"c"}}"#,
            r#""x""#,
            "[]",
            "3",
        ] {
            let json = format!(r#"{{"__metadata__":{meta}}}"#);
            rejects!(json, 0 => FormatError::InvalidMetadata { .. });
        }
        // `null` means no metadata, as the reference reads it; absent too; `{}` is kept empty.
        assert_eq!(ok(r#"{"__metadata__":null}"#, 0).metadata, None);
        assert_eq!(ok("{}", 0).metadata, None);
        assert_eq!(
            ok(r#"{"__metadata__":{}}"#, 0).metadata,
            Some(BTreeMap::new())
        );
        let h = ok(r#"{"__metadata__":{"k":"v","ü":"\u00e9\n"}}"#, 0);
        assert_eq!(h.metadata.unwrap()["ü"], "é\n");
    }

    #[test]
    fn sub_byte_dtypes_must_fill_whole_bytes() {
        rejects!(r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#, 2 =>
            FormatError::PartialBytes { .. });
        rejects!(r#"{"a":{"dtype":"F4","shape":[],"data_offsets":[0,1]}}"#, 1 =>
            FormatError::PartialBytes { .. });
        rejects!(r#"{"a":{"dtype":"F6_E2M3","shape":[2],"data_offsets":[0,2]}}"#, 2 =>
            FormatError::PartialBytes { .. });
        let h = ok(
            r#"{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}"#,
            3,
        );
        assert_eq!(h.tensors[0].len(), 3);
        let h = ok(
            r#"{"a":{"dtype":"F6_E3M2","shape":[4],"data_offsets":[0,3]}}"#,
            3,
        );
        assert_eq!(h.tensors[0].len(), 3);
        rejects!(r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,4]}}"#, 4 =>
            FormatError::OffsetsMismatch { needed: 2, .. });
    }

    #[test]
    fn zero_size_tensors_may_share_an_offset() {
        let h = ok(
            r#"{"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e2":{"dtype":"I64","shape":[3,0],"data_offsets":[0,0]},"e3":{"dtype":"BF16","shape":[0],"data_offsets":[4,4]},"e4":{"dtype":"BF16","shape":[0],"data_offsets":[4,4]}}"#,
            4,
        );
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        // Sorted by offset, ties kept in header order.
        assert_eq!(names, ["e1", "e2", "w", "e3", "e4"]);
        assert!(h.tensors[0].is_empty());
        assert_eq!(h.data_len(), 4);
        // Only empty tensors, no data.
        let h = ok(
            r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]}}"#,
            0,
        );
        assert_eq!(h.tensors.len(), 2);
    }

    #[test]
    fn accepts_unicode_names_and_any_order() {
        let h = ok(
            r#"{"z":{"dtype":"U8","shape":[1],"data_offsets":[3,4]},"名前.weight":{"dtype":"F16","shape":[],"data_offsets":[1,3]},"\u00e9":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]}}"#,
            4,
        );
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["é", "名前.weight", "z"]);
        assert_eq!(h.tensors[1].shape, Vec::<u64>::new());
    }
}

#[cfg(test)]
mod corpus {
    /// Replays the committed fuzz seeds (same input layout as `fuzz/fuzz_targets/header.rs`):
    /// none may panic, and the valid seeds must stay valid.
    #[test]
    fn fuzz_seed_corpus_replays() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/header");
        let mut accepted = 0;
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/header is committed") {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            if data.len() < 8 {
                continue;
            }
            seen += 1;
            let (extra, bytes) = data.split_at(8);
            let extra = u64::from_le_bytes(extra.try_into().unwrap());
            let size = (bytes.len() as u64).saturating_add(extra);
            if let Ok(h) = super::parse(bytes, size) {
                accepted += 1;
                assert_eq!(h.data_start + h.data_len(), size);
            }
        }
        assert!(seen >= 20, "only {seen} seeds");
        assert!(accepted >= 5, "only {accepted} seeds parse");
    }
}
