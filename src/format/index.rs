//! The index file of a sharded checkpoint (`model.safetensors.index.json`): which shard files it
//! names. Pure, like the header parser: the caller reads the bytes (capped) and adds the name.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use super::{check_complete, check_inside, FormatError};

/// The index file that sharded Hugging Face checkpoints carry.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The shard file names an index's `weight_map` lists (sorted, each once), each checked to be a
/// plain relative path inside the index's folder ([`check_inside`]) before anything reads it,
/// and every `<stem>-<K>-of-<N>.safetensors` set among them whole ([`check_complete`]: an index
/// naming 2 of 3 shards would load a smaller model).
pub fn index_shard_names(bytes: &[u8]) -> Result<Vec<String>, FormatError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| FormatError::IndexInvalidJson {
            reason: e.to_string(),
        })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or(FormatError::IndexNoWeightMap)?;
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| FormatError::IndexEntryNotAName {
                tensor: tensor.clone(),
            })?;
        if let Err(reason) = check_inside(file) {
            let (tensor, file) = (tensor.clone(), file.to_string());
            return Err(FormatError::IndexEntryOutside {
                tensor,
                file,
                reason,
            });
        }
        files.insert(file.to_string());
    }
    let files: Vec<String> = files.into_iter().collect();
    check_complete(&files)?;
    Ok(files)
}

/// The bytes of an index naming, for each tensor, the shard file that holds it, with the
/// checkpoint's `total_size`: what transformers' `save_pretrained` and `huggingface_hub` write
/// (Python's `json.dumps(index, indent=2, sort_keys=True)` and a newline, non-ASCII escaped),
/// byte for byte, so that a checkpoint saved by fastload diffs clean against one saved by them.
/// A tensor listed twice keeps its last file.
pub fn index_json<'a>(
    weight_map: impl IntoIterator<Item = (&'a str, &'a str)>,
    total_size: u64,
) -> Vec<u8> {
    let map: BTreeMap<&str, &str> = weight_map.into_iter().collect();
    let mut out = format!("{{\n  \"metadata\": {{\n    \"total_size\": {total_size}\n  }},\n");
    out.push_str("  \"weight_map\": {");
    for (i, (tensor, file)) in map.iter().enumerate() {
        out.push_str(if i == 0 { "\n    " } else { ",\n    " });
        push_json_string(&mut out, tensor);
        out.push_str(": ");
        push_json_string(&mut out, file);
    }
    out.push_str(if map.is_empty() {
        "}\n}\n"
    } else {
        "\n  }\n}\n"
    });
    out.into_bytes()
}

/// `text` as a JSON string the way Python's `json.dumps` writes it by default (`ensure_ascii`):
/// printable ASCII as is, the usual short escapes, everything else `\uXXXX` per UTF-16 unit.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_is_written_as_python_json_dumps_writes_it() {
        // json.dumps({"metadata": {"total_size": 12}, "weight_map": {...}}, indent=2,
        // sort_keys=True) + "\n", as Python 3.12 prints it.
        let map = [
            ("z", "model-00002-of-00002.safetensors"),
            ("a.w\"\\\n\u{7f}\u{1}", "model-00001-of-00002.safetensors"),
            ("é😀", "model-00001-of-00002.safetensors"),
        ];
        let want = concat!(
            "{\n  \"metadata\": {\n    \"total_size\": 12\n  },\n  \"weight_map\": {\n",
            "    \"a.w\\\"\\\\\\n\\u007f\\u0001\": \"model-00001-of-00002.safetensors\",\n",
            "    \"z\": \"model-00002-of-00002.safetensors\",\n",
            "    \"\\u00e9\\ud83d\\ude00\": \"model-00001-of-00002.safetensors\"\n",
            "  }\n}\n"
        );
        assert_eq!(String::from_utf8(index_json(map, 12)).unwrap(), want);
        assert_eq!(
            String::from_utf8(index_json([], 0)).unwrap(),
            "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n  \"weight_map\": {}\n}\n"
        );
        // What it writes, the reader takes back.
        let names = index_shard_names(&index_json(map, 12)).unwrap();
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn lists_each_shard_once_in_order() {
        let index = br#"{"metadata":{},"weight_map":{"b":"2.safetensors","a":"1.safetensors","c":"sub/2.safetensors","d":"2.safetensors"}}"#;
        assert_eq!(
            index_shard_names(index).unwrap(),
            ["1.safetensors", "2.safetensors", "sub/2.safetensors"]
        );
        assert!(index_shard_names(br#"{"weight_map":{}}"#)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn refuses_what_is_not_an_index() {
        assert!(matches!(
            index_shard_names(b"{not json"),
            Err(FormatError::IndexInvalidJson { .. })
        ));
        for doc in [
            &br#"{"metadata":{}}"#[..],
            br#"{"weight_map":[]}"#,
            b"[]",
            b"3",
        ] {
            assert_eq!(
                index_shard_names(doc),
                Err(FormatError::IndexNoWeightMap),
                "{}",
                String::from_utf8_lossy(doc)
            );
        }
        assert_eq!(
            index_shard_names(br#"{"weight_map":{"w":3}}"#),
            Err(FormatError::IndexEntryNotAName { tensor: "w".into() })
        );
    }

    #[test]
    fn refuses_an_index_naming_part_of_a_shard_set() {
        let index = br#"{"weight_map":{"a":"model-00001-of-00003.safetensors","b":"model-00003-of-00003.safetensors"}}"#;
        assert!(matches!(
            index_shard_names(index),
            Err(FormatError::ShardsMissing { ref missing, count: 1, .. })
                if missing == &["model-00002-of-00003.safetensors"]
        ));
    }

    #[test]
    fn refuses_names_outside_the_folder() {
        for file in [
            "../x.safetensors",
            "/etc/passwd",
            "a/../../b",
            "./a",
            "",
            "%2e%2e/x",
            "..\\x",
            "s3://other/x",
            "C:x",
            "x?y",
            "a\0b",
        ] {
            let doc = serde_json::json!({"weight_map": {"ok": "a.safetensors", "w": file}});
            assert_eq!(
                index_shard_names(doc.to_string().as_bytes()),
                Err(FormatError::IndexEntryOutside {
                    tensor: "w".into(),
                    file: file.into(),
                    reason: check_inside(file).unwrap_err(),
                }),
                "{file:?}"
            );
        }
    }
}
