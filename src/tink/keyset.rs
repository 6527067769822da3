//! Tink cleartext JSON keysets holding `AesGcmHkdfStreamingKey`s: the JSON as `tinkey` and
//! `tink.cleartext_keyset_handle` write it, and the key's protobuf, read by hand (three fields).
//!
//! Key bytes live in [`Zeroizing`] buffers (wiped when dropped); `Debug` shows key ids only, and
//! no error message quotes the keyset.

use std::fmt;

use serde::Deserialize;
use zeroize::Zeroizing;

/// The type URL of the one key type read.
pub const AES_GCM_HKDF_STREAMING: &str =
    "type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey";

/// The hash of the HKDF that derives each file's key (Tink's `HashType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha384,
    Sha512,
}

/// A key's parameters: what a file encrypted with it looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Bytes of each ciphertext segment, its 16-byte tag included (the last one may be shorter).
    pub segment_size: u64,
    /// Bytes of the AES key derived per file (16 or 32), and of the header's salt.
    pub derived_key_size: usize,
    pub hash: Hash,
}

/// The largest segment read: a segment is read and authenticated whole, so it bounds the extra
/// bytes a ranged read costs. Tink's own templates use 4 KiB and 1 MiB.
pub const MAX_SEGMENT_SIZE: u64 = 64 << 20;

/// One `AesGcmHkdfStreamingKey` of a keyset.
pub struct StreamingKey {
    pub key_id: u32,
    pub params: Params,
    /// The input key material of the HKDF.
    pub key_value: Zeroizing<Vec<u8>>,
}

impl fmt::Debug for StreamingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamingKey")
            .field("key_id", &self.key_id)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// The usable keys of a keyset: its enabled `AesGcmHkdfStreamingKey`s, the primary first, as
/// Tink tries them when decrypting.
pub struct Keyset {
    pub keys: Vec<StreamingKey>,
    /// The keyset's primary key id: the key Tink encrypts with.
    pub primary_key_id: Option<u32>,
}

impl fmt::Debug for Keyset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<u32> = self.keys.iter().map(|k| k.key_id).collect();
        write!(f, "Keyset {{ key_ids: {ids:?} }}")
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonKeyset {
    #[serde(default)]
    primary_key_id: Option<u32>,
    #[serde(default)]
    key: Vec<JsonKey>,
    #[serde(default)]
    encrypted_keyset: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonKey {
    key_data: Option<JsonKeyData>,
    #[serde(default)]
    status: String,
    #[serde(default)]
    key_id: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonKeyData {
    #[serde(default)]
    type_url: String,
    #[serde(default)]
    value: Zeroizing<String>,
}

impl Keyset {
    /// Parses a cleartext JSON keyset. Errors say what is wrong without quoting it.
    pub fn from_json(json: &str) -> Result<Keyset, String> {
        let parsed: JsonKeyset = serde_json::from_str(json).map_err(|e| {
            // serde's messages quote no input, only the position and the expected type.
            format!("not a Tink JSON keyset ({e})")
        })?;
        if parsed.encrypted_keyset.is_some() {
            return Err(
                "an encrypted keyset (encryptedKeyset): pass the cleartext JSON keyset \
                        (tinkey convert-keyset --out-format json, without a master key)"
                    .into(),
            );
        }
        let mut keys = Vec::new();
        let mut others = Vec::new();
        for k in &parsed.key {
            let Some(data) = &k.key_data else { continue };
            if data.type_url != AES_GCM_HKDF_STREAMING {
                others.push(data.type_url.rsplit('.').next().unwrap_or("").to_string());
                continue;
            }
            if k.status != "ENABLED" {
                continue;
            }
            // The key's protobuf holds the key: no message may ever show it.
            crate::error::remember_secret(&data.value);
            let proto = decode_base64(&data.value)
                .map_err(|e| format!("key {}: keyData.value is not base64 ({e})", k.key_id))?;
            let (params, key_value) =
                parse_key_proto(&proto).map_err(|e| format!("key {}: {e}", k.key_id))?;
            keys.push(StreamingKey {
                key_id: k.key_id,
                params,
                key_value,
            });
        }
        if keys.is_empty() {
            others.sort();
            others.dedup();
            let held = if others.is_empty() {
                "no enabled key".to_string()
            } else {
                format!("keys of type {}", others.join(", "))
            };
            return Err(format!(
                "the keyset holds no enabled AesGcmHkdfStreamingKey (a streaming-AEAD key, \
                 e.g. Tink's AES256_GCM_HKDF_1MB template); it holds {held}"
            ));
        }
        // The primary first; the others in the keyset's order.
        if let Some(primary) = parsed.primary_key_id {
            if let Some(i) = keys.iter().position(|k| k.key_id == primary) {
                let k = keys.remove(i);
                keys.insert(0, k);
            }
        }
        Ok(Keyset {
            keys,
            primary_key_id: parsed.primary_key_id,
        })
    }

    /// The key that encrypts, as Tink picks it: the primary, which must be an enabled
    /// `AesGcmHkdfStreamingKey`. Errors say why without quoting the keyset.
    pub fn primary(&self) -> Result<&StreamingKey, String> {
        let Some(id) = self.primary_key_id else {
            return Err("the keyset names no primary key (primaryKeyId), which encrypts".into());
        };
        match self.keys.first() {
            Some(k) if k.key_id == id => Ok(k),
            _ => Err(format!(
                "its primary key {id} is not an enabled AesGcmHkdfStreamingKey: it cannot encrypt"
            )),
        }
    }

    /// The keyset's [`Keyset::primary`] key alone (what a writer keeps).
    pub fn into_primary(mut self) -> Result<StreamingKey, String> {
        self.primary()?;
        Ok(self.keys.swap_remove(0))
    }

    /// The JSON keyset itself (text starting with `{`, after an optional UTF-8 byte-order mark)
    /// or the path of a file holding it. The value is remembered as a secret before it is looked
    /// at (a keyset that is not JSON, such as its base64 or the JSON in quotes, is key material
    /// all the same), and no error quotes it or the file's content: errors say what was expected
    /// and, where it shows, what the value looks like instead.
    pub fn from_spec(spec: &str) -> Result<Keyset, String> {
        crate::error::remember_secret(spec);
        let t = without_bom(spec);
        if t.starts_with('{') {
            return Keyset::from_json(t);
        }
        let text = std::fs::read(t)
            .map(|b| Zeroizing::new(String::from_utf8_lossy(&b).into_owned()))
            .map_err(|e| unreadable(t, &e))?;
        crate::error::remember_secret(&text);
        Keyset::from_json(without_bom(&text)).map_err(|e| format!("the keyset file: {e}"))
    }
}

/// What a keyset option takes, as its errors say it.
pub const EXPECTED: &str = "expected a keyset JSON, or a path to one";

/// `text` trimmed, without the UTF-8 byte-order mark some editors (and PowerShell) put first.
fn without_bom(text: &str) -> &str {
    text.trim().trim_start_matches('\u{feff}').trim_start()
}

/// Why `spec` (neither JSON nor a readable file) was not taken, without showing it: what was
/// expected, the file error, and what the value looks like when it is a known near miss.
fn unreadable(spec: &str, error: &std::io::Error) -> String {
    let quoted = |q: char| spec.len() >= 2 && spec.starts_with(q) && spec.ends_with(q);
    let looks = if quoted('"') || quoted('\'') {
        "; it is in quotes: pass the JSON without the quotes around it"
    } else if decode_base64(spec)
        .is_ok_and(|b| without_bom(&String::from_utf8_lossy(&b)).starts_with('{'))
    {
        "; it is base64-encoded JSON (as a Kubernetes secret's data holds it): decode it first, \
         or mount the secret as a file and pass its path"
    } else {
        ""
    };
    // The io error says what failed ("No such file or directory", "File name too long"); its
    // text holds no path.
    format!(
        "{EXPECTED}; this value does not start with {{ and is not a file that can be read \
         ({error}){looks} (the value is not shown: it may hold key material)"
    )
}

fn decode_base64(s: &str) -> Result<Zeroizing<Vec<u8>>, base64::DecodeError> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map(Zeroizing::new)
}

/// One protobuf field: its number and value (a varint, or the bytes of a length-delimited one).
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Other,
}

/// The fields of a protobuf message, in order (unknown wire types are an error).
fn fields(mut buf: &[u8]) -> Result<Vec<(u64, Field<'_>)>, String> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let tag = varint(&mut buf)?;
        let field = match tag & 7 {
            0 => Field::Varint(varint(&mut buf)?),
            1 | 5 => {
                let n = if tag & 7 == 1 { 8 } else { 4 };
                buf = buf.get(n..).ok_or("truncated protobuf")?;
                Field::Other
            }
            2 => {
                let n = usize::try_from(varint(&mut buf)?).map_err(|_| "bad protobuf length")?;
                let (v, rest) = (buf.get(..n), buf.get(n..));
                buf = rest.ok_or("truncated protobuf")?;
                Field::Bytes(v.ok_or("truncated protobuf")?)
            }
            w => return Err(format!("unexpected protobuf wire type {w}")),
        };
        out.push((tag >> 3, field));
    }
    Ok(out)
}

fn varint(buf: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first().ok_or("truncated protobuf")?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("bad protobuf varint".into())
}

/// `AesGcmHkdfStreamingKey { version = 1, params = 2, key_value = 3 }` with
/// `AesGcmHkdfStreamingParams { ciphertext_segment_size = 1, derived_key_size = 2,
/// hkdf_hash_type = 3 }`, checked as Tink checks them.
fn parse_key_proto(proto: &[u8]) -> Result<(Params, Zeroizing<Vec<u8>>), String> {
    let mut version = 0;
    let mut params: Option<&[u8]> = None;
    let mut key_value = Zeroizing::new(Vec::new());
    for (number, field) in fields(proto)? {
        match (number, field) {
            (1, Field::Varint(v)) => version = v,
            (2, Field::Bytes(b)) => params = Some(b),
            (3, Field::Bytes(b)) => key_value = Zeroizing::new(b.to_vec()),
            _ => {}
        }
    }
    if version != 0 {
        return Err(format!("key version {version} is not supported (0 is)"));
    }
    let (mut segment_size, mut derived_key_size, mut hash) = (0, 0, 0);
    for (number, field) in fields(params.ok_or("the key has no params")?)? {
        match (number, field) {
            (1, Field::Varint(v)) => segment_size = v,
            (2, Field::Varint(v)) => derived_key_size = v,
            (3, Field::Varint(v)) => hash = v,
            _ => {}
        }
    }
    let hash = match hash {
        1 => Hash::Sha1,
        2 => Hash::Sha384,
        3 => Hash::Sha256,
        4 => Hash::Sha512,
        h => {
            return Err(format!(
                "HKDF hash type {h} is not supported (SHA1, SHA256, SHA384, SHA512 are)"
            ))
        }
    };
    if derived_key_size != 16 && derived_key_size != 32 {
        return Err(format!(
            "derived key size {derived_key_size} is not 16 or 32"
        ));
    }
    let derived_key_size = derived_key_size as usize;
    if key_value.len() < derived_key_size {
        return Err(format!(
            "the key value is shorter ({} bytes) than the derived key ({derived_key_size})",
            key_value.len()
        ));
    }
    let min = super::layout::header_len(derived_key_size) as u64 + super::layout::TAG as u64 + 1;
    if segment_size < min || segment_size > MAX_SEGMENT_SIZE {
        return Err(format!(
            "ciphertext segment size {segment_size} is not in {min}..={MAX_SEGMENT_SIZE}"
        ));
    }
    Ok((
        Params {
            segment_size,
            derived_key_size,
            hash,
        },
        key_value,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keyset as `tink.cleartext_keyset_handle.write` wrote it (AES256_GCM_HKDF_1MB).
    pub(crate) const TINK_KEYSET: &str = r#"{
      "primaryKeyId": 82301532,
      "key": [{
        "keyData": {
          "typeUrl": "type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey",
          "value": "EggIgIBAECAYAxogC2Pid+BRndgLVC70+aTovIXwd1QmWdJw8U6+9VJ2XI0=",
          "keyMaterialType": "SYMMETRIC"
        },
        "status": "ENABLED", "keyId": 82301532, "outputPrefixType": "RAW"
      }]
    }"#;

    #[test]
    fn reads_a_tink_keyset() {
        let k = Keyset::from_json(TINK_KEYSET).unwrap();
        assert_eq!(k.keys.len(), 1);
        assert_eq!(k.keys[0].key_id, 82301532);
        assert_eq!(
            k.keys[0].params,
            Params {
                segment_size: 1 << 20,
                derived_key_size: 32,
                hash: Hash::Sha256
            }
        );
        assert_eq!(k.keys[0].key_value.len(), 32);
        let debug = format!("{k:?}");
        assert!(
            !debug.contains("EggI") && debug.contains("82301532"),
            "{debug}"
        );
    }

    /// No 12-character run of `spec` (the key material, however it is encoded) is in `error`.
    fn assert_hidden(error: &str, spec: &str) {
        let chars: Vec<char> = spec.chars().collect();
        for w in chars.windows(12) {
            let w: String = w.iter().collect();
            assert!(!error.contains(&w), "{w:?} shown in: {error}");
        }
    }

    #[test]
    fn keysets_that_are_not_json_are_refused_without_showing_them() {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(TINK_KEYSET);
        let quoted = format!("'{TINK_KEYSET}'");
        let long = "k".repeat(5000);
        for (spec, says) in [
            (b64.as_str(), "base64-encoded JSON"),
            (quoted.as_str(), "in quotes"),
            (long.as_str(), "File name too long"),
        ] {
            let e = Keyset::from_spec(spec).unwrap_err();
            assert!(e.contains(EXPECTED) && e.contains(says), "{e}");
            assert_hidden(&e, spec);
            // Remembered before it was looked at: a message that quotes it anyway is scrubbed.
            let scrubbed = crate::error::scrub(&format!("x {spec} y"));
            assert_eq!(scrubbed, "x *** y");
        }
        // A byte-order mark before the JSON, given as is or in a file, is read as the JSON.
        let with_bom = format!("\u{feff}{TINK_KEYSET}");
        assert_eq!(Keyset::from_spec(&with_bom).unwrap().keys.len(), 1);
        let file = std::env::temp_dir().join(format!("fastload-bom-{}.json", std::process::id()));
        std::fs::write(&file, &with_bom).unwrap();
        let read = Keyset::from_spec(file.to_str().unwrap());
        std::fs::remove_file(&file).unwrap();
        assert_eq!(read.unwrap().keys[0].key_id, 82301532);
    }

    #[test]
    fn rejects_other_primitives_and_junk_without_quoting() {
        let aead = TINK_KEYSET.replace("AesGcmHkdfStreamingKey", "AesGcmKey");
        let e = Keyset::from_json(&aead).unwrap_err();
        assert!(
            e.contains("AesGcmKey") && e.contains("no enabled AesGcmHkdfStreamingKey"),
            "{e}"
        );
        let disabled = TINK_KEYSET.replace("ENABLED", "DISABLED");
        assert!(Keyset::from_json(&disabled)
            .unwrap_err()
            .contains("no enabled key"));
        let e = Keyset::from_json("{\"key\": 3, \"secret\": \"x\"}").unwrap_err();
        assert!(!e.contains("secret"), "{e}");
        let bad = TINK_KEYSET.replace("EggIgIBAECAYAxog", "EggIgIBAECAYBRog");
        assert!(Keyset::from_json(&bad).unwrap_err().contains("hash type 5"));
        let e = Keyset::from_spec("/nonexistent/keyset.json").unwrap_err();
        assert!(
            e.contains(EXPECTED) && e.contains("No such file") && !e.contains("keyset.json"),
            "{e}"
        );
    }
}
