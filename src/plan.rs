//! From validated headers and options to the work: segments (contiguous byte ranges of one file,
//! each becoming one host buffer) holding the tensors that land in them. Small tensors are
//! coalesced into one segment; a tensor larger than the segment target gets a segment of its own,
//! which the pipeline reads as several blocks in parallel. Gaps left by `names` end a segment, so
//! bytes of tensors nobody asked for are never read.

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::format::Dtype;
use crate::source::Shard;

/// Where one tensor lands inside its segment's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlot {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte offset inside the segment.
    pub offset: u64,
    pub len: u64,
}

/// A contiguous range of one file, read into one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index into [`Plan::shards`].
    pub shard: usize,
    /// Absolute file offset of the first byte.
    pub start: u64,
    pub len: u64,
    pub tensors: Vec<TensorSlot>,
}

/// The whole load.
#[derive(Debug)]
pub struct Plan {
    pub shards: Vec<Shard>,
    pub segments: Vec<Segment>,
    pub total_bytes: u64,
    pub tensor_count: usize,
}

/// Segment size for a memory limit: small enough that several segments are in flight at once
/// (reads of the next overlap the consumer's work on the current one), large enough that per
/// segment costs vanish.
pub fn segment_target(memory_limit: u64, block_size: u64) -> u64 {
    (memory_limit / 4)
        .min(64 << 20)
        .max(block_size.min(memory_limit))
}

/// Builds the plan. `names` selects tensors (every name must exist somewhere); tensor names must
/// be unique across shards.
pub fn build(shards: Vec<Shard>, names: Option<&[String]>, target: u64) -> Result<Plan> {
    let mut owner: HashMap<&str, usize> = HashMap::new();
    for (i, shard) in shards.iter().enumerate() {
        for t in &shard.header.tensors {
            if let Some(prev) = owner.insert(t.name.as_str(), i) {
                return Err(Error::format(
                    &shard.name,
                    format!(
                        "tensor {:?} is also in {} (tensor names must be unique across shards)",
                        t.name, shards[prev].name
                    ),
                ));
            }
        }
    }
    let wanted: Option<HashSet<&str>> = names.map(|n| n.iter().map(String::as_str).collect());
    if let Some(w) = &wanted {
        let mut missing: Vec<&str> = w
            .iter()
            .copied()
            .filter(|n| !owner.contains_key(n))
            .collect();
        if !missing.is_empty() {
            missing.sort_unstable();
            let uri = shards.first().map_or(String::new(), |s| s.name.clone());
            let uri = if shards.len() > 1 {
                format!("{uri} and {} more files", shards.len() - 1)
            } else {
                uri
            };
            return Err(Error::MissingTensors {
                uri,
                names: missing
                    .iter()
                    .map(|n| format!("{n:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    drop(owner);

    let mut segments = Vec::new();
    let mut total_bytes = 0u64;
    let mut tensor_count = 0usize;
    for (si, shard) in shards.iter().enumerate() {
        let base = shard.header.data_start;
        let mut current: Option<Segment> = None;
        for t in &shard.header.tensors {
            if wanted
                .as_ref()
                .is_some_and(|w| !w.contains(t.name.as_str()))
            {
                if let Some(seg) = current.take() {
                    segments.push(seg);
                }
                continue;
            }
            tensor_count += 1;
            total_bytes += t.len();
            let start = base + t.begin;
            let fits = current
                .as_ref()
                .is_some_and(|s| s.start + s.len == start && s.len + t.len() <= target);
            if !fits {
                if let Some(seg) = current.take() {
                    segments.push(seg);
                }
                current = Some(Segment {
                    shard: si,
                    start,
                    len: 0,
                    tensors: Vec::new(),
                });
            }
            let seg = current.as_mut().expect("segment was just opened");
            seg.tensors.push(TensorSlot {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: seg.len,
                len: t.len(),
            });
            seg.len += t.len();
        }
        if let Some(seg) = current.take() {
            segments.push(seg);
        }
    }
    Ok(Plan {
        shards,
        segments,
        total_bytes,
        tensor_count,
    })
}

/// Splits `len` bytes into reads of at most `block` bytes: `(offset, len)` pairs.
pub fn blocks(len: u64, block: u64) -> impl Iterator<Item = (u64, u64)> {
    let block = block.max(1);
    (0..len.div_ceil(block)).map(move |i| {
        let off = i * block;
        (off, block.min(len - off))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Header, TensorEntry};
    use std::sync::Arc;

    fn shard(name: &str, sizes: &[(&str, u64)]) -> Shard {
        let mut tensors = Vec::new();
        let mut off = 0;
        for (n, len) in sizes {
            tensors.push(TensorEntry {
                name: n.to_string(),
                dtype: Dtype::U8,
                shape: vec![*len],
                begin: off,
                end: off + len,
            });
            off += len;
        }
        Shard {
            name: name.into(),
            data: crate::source::Data::Local {
                path: name.into(),
                file: Arc::new(std::fs::File::open("/dev/null").unwrap()),
            },
            size: 100 + off,
            header: Header {
                data_start: 100,
                tensors,
                metadata: Default::default(),
            },
        }
    }

    #[test]
    fn coalesces_small_and_isolates_large() {
        let s = shard("a", &[("x", 10), ("y", 10), ("big", 1000), ("z", 5)]);
        let p = build(vec![s], None, 100).unwrap();
        let lens: Vec<u64> = p.segments.iter().map(|s| s.len).collect();
        assert_eq!(lens, vec![20, 1000, 5]);
        assert_eq!(p.segments[0].start, 100);
        assert_eq!(p.segments[1].start, 120);
        assert_eq!(p.segments[0].tensors[1].offset, 10);
        assert_eq!(p.total_bytes, 1025);
        assert_eq!(p.tensor_count, 4);
    }

    #[test]
    fn names_skip_unwanted_bytes() {
        let s = shard("a", &[("x", 10), ("y", 10), ("z", 10)]);
        let names = vec!["x".to_string(), "z".to_string()];
        let p = build(vec![s], Some(&names), 1000).unwrap();
        assert_eq!(p.segments.len(), 2);
        assert_eq!((p.segments[1].start, p.segments[1].len), (120, 10));
        assert_eq!(p.total_bytes, 20);
        let missing = vec!["nope".to_string()];
        let s = shard("a", &[("x", 10)]);
        assert!(build(vec![s], Some(&missing), 1000)
            .unwrap_err()
            .to_string()
            .contains("nope"));
    }

    #[test]
    fn rejects_duplicate_names_across_shards() {
        let err = build(
            vec![shard("a", &[("x", 1)]), shard("b", &[("x", 1)])],
            None,
            10,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unique"));
    }

    #[test]
    fn splits_blocks() {
        let b: Vec<_> = blocks(10, 4).collect();
        assert_eq!(b, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(blocks(0, 4).count(), 0);
    }
}
