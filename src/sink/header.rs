//! The header a safetensors writer puts in front of the data, byte for byte as safetensors'
//! own `serialize` lays it out (pure: specs in, bytes and offsets out):
//! - tensors sorted by dtype, widest alignment first (safetensors' `Dtype` enum order, reversed),
//!   then by name (byte order), and packed back to back in that order;
//! - the JSON object `{"__metadata__":{...},"name":{"dtype":..,"shape":[..],"data_offsets":[b,e]},..}`
//!   with no whitespace, `__metadata__` first (left out when there is none), tensors in data order;
//! - spaces after the JSON up to a multiple of 8 bytes, so that the data starts 8-byte aligned;
//! - the JSON's length as a little-endian u64 first.
//!
//! safetensors keeps `__metadata__` in a hash map, so with several keys its own order varies from
//! run to run; here the keys keep the caller's order.

use std::fmt::Write as _;

use crate::format::Dtype;

/// One tensor to write: its name, dtype and shape (bytes follow from them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// Where everything goes in the file.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The first bytes of the file: the u64 length, the JSON and its padding.
    pub header: Vec<u8>,
    /// Indices into the specs, in the order their bytes follow the header.
    pub order: Vec<usize>,
    /// Each spec's byte length (indexed like the specs).
    pub sizes: Vec<u64>,
    /// Bytes after the header.
    pub data_len: u64,
}

impl Layout {
    /// The whole file's length.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }
}

/// Why a set of tensors cannot be written; the caller names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("tensor name {0:?} is used twice")]
    Duplicate(String),
    #[error("a tensor cannot be named \"__metadata__\" (the header's metadata key)")]
    ReservedName,
    #[error("tensor {name:?}: shape {shape:?} of {dtype} is too large")]
    Overflow {
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
    },
    #[error(
        "tensor {name:?}: {dtype} packs several elements per byte, and the last dimension \
         ({last}) does not fill whole bytes"
    )]
    PartialByte {
        name: String,
        dtype: Dtype,
        last: u64,
    },
}

/// Position of `d` in safetensors' `Dtype` enum (its sort key). Kept here, not derived from
/// [`Dtype`]'s own order: the file layout must follow safetensors even if ours changes.
fn alignment_rank(d: Dtype) -> u8 {
    match d {
        Dtype::Bool => 0,
        Dtype::F4 => 1,
        Dtype::F6E2M3 => 2,
        Dtype::F6E3M2 => 3,
        Dtype::U8 => 4,
        Dtype::I8 => 5,
        Dtype::F8E5M2 => 6,
        Dtype::F8E4M3 => 7,
        Dtype::F8E8M0 => 8,
        Dtype::F8E4M3Fnuz => 9,
        Dtype::F8E5M2Fnuz => 10,
        Dtype::I16 => 11,
        Dtype::U16 => 12,
        Dtype::F16 => 13,
        Dtype::BF16 => 14,
        Dtype::I32 => 15,
        Dtype::U32 => 16,
        Dtype::F32 => 17,
        Dtype::C64 => 18,
        Dtype::F64 => 19,
        Dtype::I64 => 20,
        Dtype::U64 => 21,
    }
}

/// Bytes of a tensor, with checked arithmetic.
fn byte_len(spec: &TensorSpec) -> Result<u64, LayoutError> {
    let overflow = || LayoutError::Overflow {
        name: spec.name.clone(),
        dtype: spec.dtype,
        shape: spec.shape.clone(),
    };
    let elements = spec
        .shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(overflow)?;
    let bits = elements
        .checked_mul(spec.dtype.bits())
        .ok_or_else(overflow)?;
    if bits % 8 != 0 {
        return Err(LayoutError::PartialByte {
            name: spec.name.clone(),
            dtype: spec.dtype,
            last: spec.shape.last().copied().unwrap_or(1),
        });
    }
    Ok(bits / 8)
}

/// The layout of a file holding `specs` and `metadata` (`None`: no `__metadata__` key).
pub fn layout(
    specs: &[TensorSpec],
    metadata: Option<&[(String, String)]>,
) -> Result<Layout, LayoutError> {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&specs[a], &specs[b]);
        alignment_rank(b.dtype)
            .cmp(&alignment_rank(a.dtype))
            .then_with(|| a.name.as_bytes().cmp(b.name.as_bytes()))
    });
    for pair in order.windows(2) {
        let (a, b) = (&specs[pair[0]], &specs[pair[1]]);
        if a.name == b.name {
            return Err(LayoutError::Duplicate(a.name.clone()));
        }
    }
    let sizes = specs.iter().map(byte_len).collect::<Result<Vec<_>, _>>()?;
    let mut json = String::from("{");
    if let Some(metadata) = metadata {
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in metadata.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            push_str(&mut json, k);
            json.push(':');
            push_str(&mut json, v);
        }
        json.push('}');
    }
    let mut offset = 0u64;
    for (i, &at) in order.iter().enumerate() {
        let spec = &specs[at];
        if spec.name == "__metadata__" {
            return Err(LayoutError::ReservedName);
        }
        if i > 0 || metadata.is_some() {
            json.push(',');
        }
        let end = offset
            .checked_add(sizes[at])
            .ok_or_else(|| LayoutError::Overflow {
                name: spec.name.clone(),
                dtype: spec.dtype,
                shape: spec.shape.clone(),
            })?;
        push_str(&mut json, &spec.name);
        let _ = write!(json, ":{{\"dtype\":\"{}\",\"shape\":[", spec.dtype.as_str());
        for (d, dim) in spec.shape.iter().enumerate() {
            if d > 0 {
                json.push(',');
            }
            let _ = write!(json, "{dim}");
        }
        let _ = write!(json, "],\"data_offsets\":[{offset},{end}]}}");
        offset = end;
    }
    json.push('}');
    let pad = (8 - json.len() % 8) % 8;
    json.extend(std::iter::repeat_n(' ', pad));
    let mut header = Vec::with_capacity(8 + json.len());
    header.extend_from_slice(&(json.len() as u64).to_le_bytes());
    header.extend_from_slice(json.as_bytes());
    Ok(Layout {
        header,
        order,
        sizes,
        data_len: offset,
    })
}

/// `s` as a JSON string, escaped as serde_json escapes it (which safetensors uses).
fn push_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).expect("a str always serialises"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// safetensors' own unit test (`test_serialization`): one F32 [1,2,3] named "attn.0".
    #[test]
    fn one_tensor_as_safetensors_lays_it_out() {
        let l = layout(&[spec("attn.0", Dtype::F32, &[1, 2, 3])], None).unwrap();
        let json = br#"{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}"#;
        assert_eq!(&l.header[..8], &64u64.to_le_bytes());
        assert_eq!(&l.header[8..8 + json.len()], json);
        assert_eq!(l.header.len(), 8 + 64);
        assert!(l.header[8 + json.len()..].iter().all(|&b| b == b' '));
        assert_eq!(l.data_len, 24);
        assert_eq!(l.file_len(), 8 + 64 + 24);
    }

    #[test]
    fn empty_file_and_metadata_only() {
        let l = layout(&[], None).unwrap();
        assert_eq!(l.header, b"\x08\0\0\0\0\0\0\0{}      ");
        let meta = [("framework".to_string(), "pt".to_string())];
        let l = layout(&[], Some(&meta)).unwrap();
        let json = br#"{"__metadata__":{"framework":"pt"}}     "#;
        assert_eq!(&l.header[..8], &(json.len() as u64).to_le_bytes());
        assert_eq!(&l.header[8..], json);
    }

    #[test]
    fn widest_dtype_first_then_by_name() {
        let specs = [
            spec("b", Dtype::U8, &[3]),
            spec("a", Dtype::U8, &[1]),
            spec("z", Dtype::F64, &[1]),
            spec("m", Dtype::BF16, &[2]),
            spec("c", Dtype::Bool, &[]),
            spec("e", Dtype::F8E4M3Fnuz, &[1]),
            spec("f", Dtype::F8E8M0, &[1]),
        ];
        let l = layout(&specs, None).unwrap();
        let names: Vec<&str> = l.order.iter().map(|&i| specs[i].name.as_str()).collect();
        assert_eq!(names, ["z", "m", "e", "f", "a", "b", "c"]);
        assert_eq!(l.sizes, [3, 1, 8, 4, 1, 1, 1]);
        assert_eq!(l.data_len, 19);
        assert_eq!(l.header.len() % 8, 0);
        let text = std::str::from_utf8(&l.header[8..]).unwrap();
        assert!(text.contains(r#""z":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}"#));
        assert!(text.contains(r#""c":{"dtype":"BOOL","shape":[],"data_offsets":[18,19]}"#));
    }

    #[test]
    fn names_are_escaped_as_json_and_sorted_by_bytes() {
        let specs = [
            spec("é\"\n", Dtype::F32, &[0]),
            spec("Z", Dtype::F32, &[0, 4]),
        ];
        let l = layout(&specs, None).unwrap();
        let text = std::str::from_utf8(&l.header[8..]).unwrap().trim_end();
        assert_eq!(
            text,
            "{\"Z\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]},\
             \"é\\\"\\n\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}"
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        let twice = [spec("a", Dtype::F32, &[1]), spec("a", Dtype::U8, &[1])];
        assert!(matches!(layout(&twice, None), Err(LayoutError::Duplicate(n)) if n == "a"));
        let reserved = [spec("__metadata__", Dtype::F32, &[1])];
        assert_eq!(
            layout(&reserved, None).unwrap_err(),
            LayoutError::ReservedName
        );
        let huge = [spec("h", Dtype::F64, &[u64::MAX, 2])];
        assert!(matches!(
            layout(&huge, None),
            Err(LayoutError::Overflow { .. })
        ));
        let odd = [spec("f4", Dtype::F4, &[3])];
        assert!(matches!(
            layout(&odd, None),
            Err(LayoutError::PartialByte { .. })
        ));
        assert_eq!(
            layout(&[spec("f4", Dtype::F4, &[4])], None)
                .unwrap()
                .data_len,
            2
        );
    }
}
