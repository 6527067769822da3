//! The header's JSON with serde: tensor entries in file order, duplicates refused, and what the
//! visitor refuses turned into typed errors.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::{FormatError, JsonPosition};

/// The JSON of a header. serde's errors are strings, so what the visitor rejects is kept aside
/// and becomes its own variant, with the position serde_json reports.
pub(super) fn parse_json(text: &str) -> Result<RawHeader, FormatError> {
    let mut rejected = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = RawHeaderSeed {
        rejected: &mut rejected,
    }
    .deserialize(&mut de)
    .and_then(|raw| de.end().map(|()| raw));
    parsed.map_err(|e| {
        let at = JsonPosition::of(&e);
        match rejected {
            Some(Rejected::DuplicateMetadata) => FormatError::DuplicateMetadata { at },
            Some(Rejected::Metadata(reason)) => FormatError::InvalidMetadata {
                reason: without_position(&reason).to_string(),
                at,
            },
            Some(Rejected::DuplicateTensor(name)) => FormatError::DuplicateTensor { name, at },
            Some(Rejected::Entry { name, reason }) => FormatError::InvalidEntry {
                name,
                reason: without_position(&reason).to_string(),
                at,
            },
            None => FormatError::InvalidJson {
                reason: e.to_string(),
            },
        }
    })
}

#[derive(Deserialize)]
pub(super) struct RawInfo {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data_offsets: [u64; 2],
}

pub(super) struct RawHeader {
    pub metadata: Option<BTreeMap<String, String>>,
    pub tensors: Vec<(String, RawInfo)>,
}

/// What the header visitor refused. Its text is the custom serde error, so serde_json places the
/// error where it placed the inner one.
enum Rejected {
    DuplicateMetadata,
    Metadata(String),
    DuplicateTensor(String),
    Entry { name: String, reason: String },
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejected::DuplicateMetadata => f.write_str("duplicate __metadata__"),
            Rejected::Metadata(reason) => write!(f, "__metadata__: {reason}"),
            Rejected::DuplicateTensor(name) => write!(f, "duplicate tensor name {name:?}"),
            Rejected::Entry { name, reason } => write!(f, "tensor {name:?}: {reason}"),
        }
    }
}

/// `message` without the " at line L column C" that serde_json appends. serde_json moves such a
/// suffix of a custom message into the error's position, so `at` already holds it.
fn without_position(message: &str) -> &str {
    let Some((text, at)) = message.rsplit_once(" at line ") else {
        return message;
    };
    let numbers = at.split_once(" column ").filter(|(l, c)| {
        [l, c]
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if numbers.is_some() {
        text
    } else {
        message
    }
}

struct RawHeaderSeed<'a> {
    rejected: &'a mut Option<Rejected>,
}

impl<'de> DeserializeSeed<'de> for RawHeaderSeed<'_> {
    type Value = RawHeader;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<RawHeader, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl RawHeaderSeed<'_> {
    fn reject<E: de::Error>(self, why: Rejected) -> E {
        let e = E::custom(&why);
        *self.rejected = Some(why);
        e
    }
}

impl<'de> Visitor<'de> for RawHeaderSeed<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        // `None` inside: `"__metadata__": null`, which the reference reads as no metadata.
        let mut metadata: Option<Option<BTreeMap<String, String>>> = None;
        let mut tensors = Vec::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "__metadata__" {
                if metadata.is_some() {
                    return Err(self.reject(Rejected::DuplicateMetadata));
                }
                match map.next_value::<Option<BTreeMap<String, String>>>() {
                    Ok(m) => metadata = Some(m),
                    Err(e) => {
                        return Err(self.reject(Rejected::Metadata(e.to_string())));
                    }
                }
            } else {
                if !seen.insert(key.clone()) {
                    return Err(self.reject(Rejected::DuplicateTensor(key)));
                }
                match map.next_value::<RawInfo>() {
                    Ok(info) => tensors.push((key, info)),
                    Err(e) => {
                        let reason = e.to_string();
                        return Err(self.reject(Rejected::Entry { name: key, reason }));
                    }
                }
            }
        }
        Ok(RawHeader {
            metadata: metadata.flatten(),
            tensors,
        })
    }
}
