//! The safetensors header: bytes in, validated tensor entries out.
//!
//! Pure and allocation-bounded: nothing here trusts a length before checking it against the
//! file size, every size computation is checked, and the tensors must tile the data section
//! exactly (no overlaps, no gaps, nothing past the end). Fuzzed by `fuzz/fuzz_targets/header.rs`.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// Bytes of the little-endian header-length prefix.
pub const PREFIX_LEN: u64 = 8;
/// Largest header accepted, as in the reference implementation.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Why a header was rejected; the caller adds the file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatError(pub String);

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn fail<T>(message: impl Into<String>) -> Result<T, FormatError> {
    Err(FormatError(message.into()))
}

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
    /// The optional `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
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
        return fail(format!(
            "file is {file_size} bytes, too small to hold the 8-byte header length"
        ));
    }
    if prefix.len() < PREFIX_LEN as usize {
        return fail(format!(
            "only {} bytes given, too few to hold the 8-byte header length",
            prefix.len()
        ));
    }
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&prefix[..8]);
    let n = u64::from_le_bytes(raw);
    if n > MAX_HEADER_LEN {
        return fail(format!(
            "header length {n} is over the {MAX_HEADER_LEN}-byte limit"
        ));
    }
    if n > file_size - PREFIX_LEN {
        return fail(format!(
            "header length {n} runs past the end of the file ({file_size} bytes)"
        ));
    }
    if n < 2 {
        return fail(format!("header length {n} is too small for a JSON object"));
    }
    Ok(n)
}

/// Parses and validates the JSON header (the `n` bytes after the prefix) of a file of
/// `file_size` bytes.
pub fn parse_header(json: &[u8], file_size: u64) -> Result<Header, FormatError> {
    let n = json.len() as u64;
    let data_start = PREFIX_LEN
        .checked_add(n)
        .filter(|&s| s <= file_size)
        .ok_or_else(|| FormatError(format!("header length {n} runs past the end of the file")))?;
    let text = std::str::from_utf8(json)
        .map_err(|e| FormatError(format!("header is not valid UTF-8 ({e})")))?;
    if !text.starts_with('{') {
        return fail("header does not start with '{'");
    }
    let raw: RawHeader = serde_json::from_str(text)
        .map_err(|e| FormatError(format!("header is not valid JSON: {e}")))?;
    let data_len = file_size - data_start;

    let mut tensors = Vec::with_capacity(raw.tensors.len());
    for (name, info) in raw.tensors {
        let dtype = Dtype::parse(&info.dtype).ok_or_else(|| {
            FormatError(format!(
                "tensor {name:?} has unknown dtype {:?}",
                info.dtype
            ))
        })?;
        let [begin, end] = info.data_offsets;
        if begin > end {
            return fail(format!(
                "tensor {name:?} has data_offsets [{begin}, {end}] that run backwards"
            ));
        }
        if end > data_len {
            return fail(format!(
                "tensor {name:?} has data_offsets [{begin}, {end}] past the end of the data section ({data_len} bytes)"
            ));
        }
        let bits = info
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|elems| elems.checked_mul(dtype.bits()))
            .ok_or_else(|| {
                FormatError(format!("tensor {name:?} shape {:?} overflows", info.shape))
            })?;
        if bits % 8 != 0 {
            return fail(format!(
                "tensor {name:?} of {dtype} with shape {:?} does not fill whole bytes",
                info.shape
            ));
        }
        if bits / 8 != end - begin {
            return fail(format!(
                "tensor {name:?} of {dtype} with shape {:?} needs {} bytes but data_offsets [{begin}, {end}] hold {}",
                info.shape,
                bits / 8,
                end - begin
            ));
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape: info.shape,
            begin,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.begin, t.end));

    let mut cursor = 0u64;
    for t in &tensors {
        if t.begin < cursor {
            return fail(format!(
                "tensor {:?} at [{}, {}] overlaps the previous tensor (which ends at {cursor})",
                t.name, t.begin, t.end
            ));
        }
        if t.begin > cursor {
            return fail(format!(
                "gap in the data section: bytes [{cursor}, {}] before tensor {:?} belong to no tensor",
                t.begin, t.name
            ));
        }
        cursor = t.end;
    }
    if cursor != data_len {
        return fail(format!(
            "tensors cover {cursor} bytes but the data section holds {data_len} (file is {file_size} bytes)"
        ));
    }
    Ok(Header {
        data_start,
        tensors,
        metadata: raw.metadata,
    })
}

/// Parses a header from the first bytes of a file (`bytes` holds at least the prefix and the
/// JSON, and may hold more). The entry point for the fuzzer.
pub fn parse(bytes: &[u8], file_size: u64) -> Result<Header, FormatError> {
    let n = header_len(bytes, file_size)?;
    let end = (PREFIX_LEN + n) as usize;
    if bytes.len() < end {
        return fail(format!(
            "header needs {end} bytes but only {} were given",
            bytes.len()
        ));
    }
    parse_header(&bytes[PREFIX_LEN as usize..end], file_size)
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

struct RawHeader {
    metadata: BTreeMap<String, String>,
    tensors: Vec<(String, RawInfo)>,
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(RawHeaderVisitor)
    }
}

struct RawHeaderVisitor;

impl<'de> Visitor<'de> for RawHeaderVisitor {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut metadata = None;
        let mut tensors = Vec::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "__metadata__" {
                if metadata.is_some() {
                    return Err(de::Error::custom("duplicate __metadata__"));
                }
                let m: Option<BTreeMap<String, String>> = map
                    .next_value()
                    .map_err(|e| de::Error::custom(format!("__metadata__: {e}")))?;
                metadata = Some(m.unwrap_or_default());
            } else {
                if !seen.insert(key.clone()) {
                    return Err(de::Error::custom(format!("duplicate tensor name {key:?}")));
                }
                let info: RawInfo = map
                    .next_value()
                    .map_err(|e| de::Error::custom(format!("tensor {key:?}: {e}")))?;
                tensors.push((key, info));
            }
        }
        Ok(RawHeader {
            metadata: metadata.unwrap_or_default(),
            tensors,
        })
    }
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
        assert_eq!(h.metadata["format"], "pt");
    }

    #[test]
    fn rejects_gaps_overlaps_and_short_data() {
        let gap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#;
        let (b, size) = file(gap, 5);
        assert!(parse(&b, size).unwrap_err().0.contains("gap"));
        let overlap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        let (b, size) = file(overlap, 3);
        assert!(parse(&b, size).unwrap_err().0.contains("overlaps"));
        let short = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let (b, size) = file(short, 3);
        assert!(parse(&b, size).unwrap_err().0.contains("past the end"));
    }

    #[test]
    fn rejects_bad_lengths_without_allocating() {
        let mut b = u64::MAX.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(parse(&b, 10).unwrap_err().0.contains("limit"));
        let mut b = 1000u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(parse(&b, 10).unwrap_err().0.contains("past the end"));
        assert!(parse(b"abc", 3).unwrap_err().0.contains("too small"));
    }

    #[test]
    fn rejects_overflowing_shapes_and_bad_dtypes() {
        let big =
            r#"{"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#;
        let (b, size) = file(big, 0);
        assert!(parse(&b, size).unwrap_err().0.contains("overflows"));
        let bad = r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#;
        let (b, size) = file(bad, 16);
        assert!(parse(&b, size).unwrap_err().0.contains("unknown dtype"));
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        let (b, size) = file(dup, 2);
        assert!(parse(&b, size).unwrap_err().0.contains("duplicate"));
    }

    fn err(json: &str, data_len: u64) -> String {
        let (b, size) = file(json, data_len);
        parse(&b, size).unwrap_err().0
    }

    fn ok(json: &str, data_len: u64) -> Header {
        let (b, size) = file(json, data_len);
        parse(&b, size).unwrap()
    }

    fn raw_file(json: &[u8], data_len: u64) -> (Vec<u8>, u64) {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json);
        let size = v.len() as u64 + data_len;
        (v, size)
    }

    #[test]
    fn rejects_invalid_utf8() {
        let (b, size) = raw_file(
            b"{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}",
            1,
        );
        assert!(parse(&b, size).unwrap_err().0.contains("UTF-8"));
        // A multi-byte sequence cut off by the header length.
        let (b, size) = raw_file("{\"é\":1}".as_bytes().split_at(3).0, 0);
        assert!(parse(&b, size).unwrap_err().0.contains("UTF-8"));
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
            let e = err(json, 1);
            assert!(e.contains("not valid JSON"), "{json}: {e}");
        }
        // The error names the offending tensor.
        assert!(err("{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1).contains("\"w\""));
    }

    #[test]
    fn rejects_json_that_is_not_an_object() {
        for json in [
            "[]", "[1,2]", "\"{}\"", "123", "null", "true", " {}", "\n{}",
        ] {
            let e = err(json, 0);
            assert!(e.contains("'{'"), "{json}: {e}");
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
        assert!(err(&unbalanced, 1).contains("not valid JSON"));
        let deep_meta = format!(
            "{{\"__metadata__\":{}{}}}",
            "{\"k\":".repeat(50_000),
            "}".repeat(50_000)
        );
        assert!(err(&deep_meta, 0).contains("not valid JSON"));
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
            let e = err(&json, 4);
            assert!(e.contains("unknown dtype"), "{dtype}: {e}");
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
            "[18446744073709551615,2]",
            "[4294967296,4294967296]",
            "[1,1,1,18446744073709551615]",
            // Product fits in u64 but the bit count does not.
            "[2305843009213693952]",
        ] {
            let json = format!(r#"{{"a":{{"dtype":"F64","shape":{shape},"data_offsets":[0,8]}}}}"#);
            let e = err(&json, 8);
            assert!(e.contains("overflows"), "{shape}: {e}");
        }
        // A zero dimension makes the product zero even beside huge ones: no overflow, 0 bytes.
        let h = ok(
            r#"{"a":{"dtype":"F64","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#,
            0,
        );
        assert_eq!(h.tensors[0].len(), 0);
    }

    #[test]
    fn rejects_sizes_that_disagree_with_the_shape() {
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(e.contains("needs 8 bytes"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F32","shape":[],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(e.contains("needs 4 bytes"), "{e}");
    }

    #[test]
    fn rejects_offsets_out_of_range() {
        // End past the data section.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            2,
        );
        assert!(
            e.contains("past the end of the data section (2 bytes)"),
            "{e}"
        );
        // Offsets near u64::MAX with a consistent length must not overflow anything.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#,
            1,
        );
        assert!(e.contains("past the end"), "{e}");
        // Backwards offsets.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            4,
        );
        assert!(e.contains("backwards"), "{e}");
    }

    #[test]
    fn rejects_overlapping_tensors() {
        // Identical ranges.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
            2,
        );
        assert!(e.contains("overlaps"), "{e}");
        // One inside another.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
            8,
        );
        assert!(e.contains("overlaps"), "{e}");
        // An empty tensor in the middle of another one.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}"#,
            8,
        );
        assert!(e.contains("overlaps"), "{e}");
    }

    #[test]
    fn rejects_gaps() {
        // Gap at the start.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
            4,
        );
        assert!(e.contains("gap") && e.contains("[0, 2]"), "{e}");
        // An empty tensor after a gap; the data is long enough for the offsets.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}}"#,
            12,
        );
        assert!(e.contains("gap") && e.contains("[4, 9]"), "{e}");
        // The same empty tensor past the end of the data.
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}}"#,
            4,
        );
        assert!(e.contains("past the end"), "{e}");
    }

    #[test]
    fn rejects_data_longer_than_the_tensors() {
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            5,
        );
        assert!(e.contains("cover 4 bytes") && e.contains("holds 5"), "{e}");
        let e = err("{}", 1);
        assert!(e.contains("cover 0 bytes"), "{e}");
    }

    #[test]
    fn accepts_empty_headers_and_files_without_tensors() {
        let h = ok("{}", 0);
        assert!(h.tensors.is_empty());
        assert_eq!(h.data_len(), 0);
        let h = ok("{}      ", 0);
        assert_eq!(h.data_start, 16);
        let h = ok(r#"{"__metadata__":{"format":"pt"}}"#, 0);
        assert_eq!(h.metadata.len(), 1);
    }

    #[test]
    fn header_length_checks() {
        // Past the end of the file, by one byte.
        let (b, size) = file("{}", 0);
        assert!(parse(&b, size - 1).unwrap_err().0.contains("past the end"));
        // Exactly the limit is allowed as far as the limit goes (then runs past the end here).
        let mut b = MAX_HEADER_LEN.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(parse(&b, 100).unwrap_err().0.contains("past the end"));
        // One over the limit is refused even if the file is big enough.
        let mut b = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let e = parse(&b, u64::MAX).unwrap_err().0;
        assert!(e.contains("limit"), "{e}");
        // 2**63 and u64::MAX: refused on the limit, no arithmetic overflow.
        for n in [1u64 << 63, u64::MAX, u64::MAX - 7] {
            let e = header_len(&n.to_le_bytes(), u64::MAX).unwrap_err().0;
            assert!(e.contains("limit"), "{n}: {e}");
        }
        // Lengths too small for "{}".
        for n in [0u64, 1] {
            let mut b = n.to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            assert!(parse(&b, 10).unwrap_err().0.contains("too small"));
        }
        // Files and prefixes shorter than 8 bytes.
        for size in 0..8u64 {
            let b = vec![0u8; size as usize];
            assert!(parse(&b, size).unwrap_err().0.contains("too small"));
        }
        assert!(header_len(&[2, 0, 0], 100)
            .unwrap_err()
            .0
            .contains("too few"));
        // The caller handed over fewer bytes than the header needs.
        let (b, size) = file("{}", 0);
        assert!(parse(&b[..9], size).unwrap_err().0.contains("only 9"));
        assert_eq!(header_len(&b, size), Ok(2));
    }

    #[test]
    fn parse_header_checks_its_length_against_the_file() {
        assert!(parse_header(b"{}", 9)
            .unwrap_err()
            .0
            .contains("past the end"));
        assert!(parse_header(b"{}", u64::MAX)
            .unwrap_err()
            .0
            .contains("cover 0 bytes"));
        assert_eq!(parse_header(b"{}", 10).unwrap().data_start, 10);
    }

    #[test]
    fn rejects_duplicates() {
        let e = err(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        );
        assert!(e.contains("duplicate tensor name \"a\""), "{e}");
        let e = err(r#"{"__metadata__":{},"__metadata__":{}}"#, 0);
        assert!(e.contains("duplicate __metadata__"), "{e}");
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
            let e = err(&json, 0);
            assert!(
                e.contains("not valid JSON") && e.contains("__metadata__"),
                "{meta}: {e}"
            );
        }
        // `null` means no metadata, as the reference reads it.
        assert!(ok(r#"{"__metadata__":null}"#, 0).metadata.is_empty());
        let h = ok(r#"{"__metadata__":{"k":"v","ü":"\u00e9\n"}}"#, 0);
        assert_eq!(h.metadata["ü"], "é\n");
    }

    #[test]
    fn sub_byte_dtypes_must_fill_whole_bytes() {
        let e = err(
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
            2,
        );
        assert!(e.contains("whole bytes"), "{e}");
        let e = err(r#"{"a":{"dtype":"F4","shape":[],"data_offsets":[0,1]}}"#, 1);
        assert!(e.contains("whole bytes"), "{e}");
        let e = err(
            r#"{"a":{"dtype":"F6_E2M3","shape":[2],"data_offsets":[0,2]}}"#,
            2,
        );
        assert!(e.contains("whole bytes"), "{e}");
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
        let e = err(
            r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(e.contains("needs 2 bytes"), "{e}");
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
