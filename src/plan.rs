//! From validated headers and options to the work: segments (contiguous byte ranges of one file,
//! each becoming one host buffer) holding the tensors that land in them. Small tensors are
//! coalesced into one segment; a tensor larger than the segment size gets a segment of its own,
//! which the pipeline reads as several blocks in parallel. Gaps left by `names` end a segment, so
//! bytes of tensors nobody asked for are never read.

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::format::{Dtype, FormatError, TensorEntry};
use crate::source::Shard;

/// Where one tensor (or one piece of a tensor) lands inside its segment's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlot {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte offset inside the segment.
    pub offset: u64,
    pub len: u64,
    /// `Some(begin)` when the slot is a piece (see [`build_parts`]): bytes `begin..begin + len` of
    /// tensor `name`, with dtype U8 and shape `[len]`. `None` for a whole tensor.
    pub piece: Option<u64>,
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
    /// Slots to deliver: tensors, or pieces for [`build_parts`].
    pub tensor_count: usize,
}

pub use crate::options::Part;

impl Plan {
    /// What segment `index` holds, for messages: ` for tensor "a" of FILE`, or ` for tensors "a",
    /// "b", ... (N in all) of FILE`.
    pub fn describe(&self, index: usize) -> String {
        let seg = &self.segments[index];
        let file = &self.shards[seg.shard].name;
        let names: Vec<String> = seg
            .tensors
            .iter()
            .map(|t| format!("{:?}", t.name))
            .collect();
        match names.as_slice() {
            [one] => format!(" for tensor {one} of {file}"),
            many if many.len() <= 3 => format!(" for tensors {} of {file}", many.join(", ")),
            many => format!(
                " for tensors {}, ... ({} in all) of {file}",
                many[..3].join(", "),
                many.len()
            ),
        }
    }
}

/// Segment size for a memory limit: small enough that several segments are in flight at once
/// (reads of the next overlap the consumer's work on the current one), large enough that per
/// segment costs vanish.
pub fn segment_size(memory_limit: u64, block_size: u64) -> u64 {
    (memory_limit / 4)
        .min(64 << 20)
        .max(block_size.min(memory_limit))
}

/// Builds the plan. `names` selects tensors (every name must exist somewhere); tensor names must
/// be unique across shards.
pub fn build(shards: Vec<Shard>, names: Option<&[String]>, segment_size: u64) -> Result<Plan> {
    let owner = owners(&shards)?;
    let wanted: Option<HashSet<&str>> = names.map(|n| n.iter().map(String::as_str).collect());
    if let Some(w) = &wanted {
        check_present(&shards, &owner, w.iter().copied())?;
    }
    drop(owner);
    coalesce(shards, segment_size, |t, slots| {
        let keep = match &wanted {
            Some(w) => w.contains(t.name.as_str()),
            None => true,
        };
        if keep {
            slots.push((t.begin, whole(t)));
        }
    })
}

/// Builds a plan that reads only `parts`: byte ranges within tensors, each delivered as a U8
/// slot with [`TensorSlot::piece`] set. This is how the ranks of a process group each read their
/// share of a checkpoint, splitting tensors where the shares meet. Ranges of one tensor must not
/// overlap; adjacent pieces coalesce into one segment like small tensors do, and no other byte
/// is read.
pub fn build_parts(shards: Vec<Shard>, parts: &[Part], segment_size: u64) -> Result<Plan> {
    let owner = owners(&shards)?;
    check_present(&shards, &owner, parts.iter().map(|p| p.0.as_str()))?;
    let mut ranges: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for (name, begin, end) in parts {
        ranges
            .entry(name.as_str())
            .or_default()
            .push((*begin, *end));
    }
    let lens: HashMap<&str, u64> = shards
        .iter()
        .flat_map(|s| s.header.tensors.iter())
        .filter(|t| ranges.contains_key(t.name.as_str()))
        .map(|t| (t.name.as_str(), t.len()))
        .collect();
    for (name, list) in &mut ranges {
        let len = lens.get(name).copied().unwrap_or(0);
        list.sort_unstable();
        let mut cursor = 0u64;
        for &(begin, end) in list.iter() {
            if begin > end || end > len {
                return Err(Error::option(
                    "parts",
                    format!("bytes {begin}..{end} of tensor {name:?} are outside its {len} bytes"),
                ));
            }
            if begin < cursor {
                return Err(Error::option(
                    "parts",
                    format!("ranges of tensor {name:?} overlap at byte {begin}"),
                ));
            }
            cursor = end;
        }
    }
    drop(owner);
    coalesce(shards, segment_size, |t, slots| {
        for &(begin, end) in ranges.get(t.name.as_str()).into_iter().flatten() {
            slots.push((
                t.begin + begin,
                TensorSlot {
                    name: t.name.clone(),
                    dtype: Dtype::U8,
                    shape: vec![end - begin],
                    offset: 0,
                    len: end - begin,
                    piece: Some(begin),
                },
            ));
        }
    })
}

/// Which shard holds each tensor; an error if a name is in two shards.
fn owners(shards: &[Shard]) -> Result<HashMap<&str, usize>> {
    let mut owner: HashMap<&str, usize> = HashMap::new();
    for (i, shard) in shards.iter().enumerate() {
        for t in &shard.header.tensors {
            if let Some(prev) = owner.insert(t.name.as_str(), i) {
                let name = t.name.clone();
                let other = shards[prev].name.clone();
                return Err(Error::format(
                    &shard.name,
                    FormatError::DuplicateAcrossShards { name, other },
                ));
            }
        }
    }
    Ok(owner)
}

fn check_present<'a>(
    shards: &[Shard],
    owner: &HashMap<&str, usize>,
    names: impl Iterator<Item = &'a str>,
) -> Result<()> {
    let mut missing: Vec<&str> = names.filter(|n| !owner.contains_key(n)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    missing.sort_unstable();
    missing.dedup();
    let uri = shards.first().map_or(String::new(), |s| s.name.clone());
    let uri = if shards.len() > 1 {
        format!("{uri} and {} more files", shards.len() - 1)
    } else {
        uri
    };
    Err(Error::MissingTensors {
        uri,
        names: missing.iter().map(|n| n.to_string()).collect(),
    })
}

fn whole(t: &TensorEntry) -> TensorSlot {
    TensorSlot {
        name: t.name.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        offset: 0,
        len: t.len(),
        piece: None,
    }
}

/// Walks every shard's tensors in file order; `select` pushes the slots wanted from a tensor as
/// `(offset within the data section, slot)`, in file order. Contiguous slots share a segment up
/// to `segment_size` bytes; any gap (a tensor or bytes nobody asked for) ends the segment.
fn coalesce(
    shards: Vec<Shard>,
    segment_size: u64,
    mut select: impl FnMut(&TensorEntry, &mut Vec<(u64, TensorSlot)>),
) -> Result<Plan> {
    let mut segments = Vec::new();
    let mut total_bytes = 0u64;
    let mut tensor_count = 0usize;
    let mut slots = Vec::new();
    for (si, shard) in shards.iter().enumerate() {
        let base = shard.header.data_start;
        let mut current: Option<Segment> = None;
        for t in &shard.header.tensors {
            slots.clear();
            select(t, &mut slots);
            if slots.is_empty() {
                if let Some(seg) = current.take() {
                    segments.push(seg);
                }
                continue;
            }
            for (begin, mut slot) in slots.drain(..) {
                tensor_count += 1;
                total_bytes += slot.len;
                let start = base + begin;
                let fits = current
                    .as_ref()
                    .is_some_and(|s| s.start + s.len == start && s.len + slot.len <= segment_size);
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
                slot.offset = seg.len;
                seg.len += slot.len;
                seg.tensors.push(slot);
            }
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

/// Splits the `len` bytes that start at file offset `start` into reads of at most `block` bytes,
/// cut at file offsets that are multiples of `block`: `(offset within the range, len)` pairs.
/// Aligned cuts match how object stores keep large objects (in fixed-size parts), so ranged GETs
/// rarely straddle two parts; the first and last reads may be short.
pub fn blocks(start: u64, len: u64, block: u64) -> impl Iterator<Item = (u64, u64)> {
    let block = block.max(1);
    let end = start + len;
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let next = ((at / block) + 1).saturating_mul(block).min(end);
        let piece = (at - start, next - at);
        at = next;
        Some(piece)
    })
}

/// [`blocks`] for a source whose reads are best cut on a grid (`Source::grid`: units starting
/// at offsets `k * unit - shift`): reads of whole units, at most `block` bytes, cut only at grid
/// points, so that no two reads share a unit; the first and last may be short. A `block` smaller
/// than a unit (reads must not exceed it: a staging slot) is cut as [`blocks`] cuts.
pub fn blocks_on(
    start: u64,
    len: u64,
    block: u64,
    grid: Option<(u64, u64)>,
) -> impl Iterator<Item = (u64, u64)> {
    match grid {
        Some((unit, shift)) if unit > 0 && unit <= block => {
            let block = block / unit * unit;
            // Cut points `o` with (o + shift) % block == 0: the same cuts, shifted.
            blocks(start + shift % block, len, block)
        }
        _ => blocks(start, len, block),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Header;
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
            source: Arc::new(crate::source::testing::Bytes {
                name: name.into(),
                data: Vec::new(),
            }),
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
        let err = build(vec![s], Some(&missing), 1000).unwrap_err();
        assert!(
            matches!(err, Error::MissingTensors { ref names, .. } if *names == ["nope"]),
            "{err}"
        );
    }

    #[test]
    fn rejects_duplicate_names_across_shards() {
        let err = build(
            vec![shard("a", &[("x", 1)]), shard("b", &[("x", 1)])],
            None,
            10,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Format {
                    ref path,
                    source: FormatError::DuplicateAcrossShards { ref name, ref other },
                } if path == "b" && name == "x" && other == "a"
            ),
            "{err}"
        );
    }

    #[test]
    fn parts_read_only_their_bytes_and_coalesce() {
        let s = shard("a", &[("x", 10), ("y", 10), ("big", 1000), ("z", 5)]);
        let parts: Vec<Part> = vec![
            ("big".into(), 40, 100),
            ("y".into(), 5, 10),
            ("big".into(), 0, 40),
            ("big".into(), 500, 600),
            ("z".into(), 0, 5),
        ];
        let p = build_parts(vec![s], &parts, 100).unwrap();
        let segs: Vec<(u64, u64)> = p.segments.iter().map(|s| (s.start, s.len)).collect();
        // y's tail and big's head touch; the next piece would pass the segment size; 500..600 stands
        // apart (a gap) and z is not adjacent to it either.
        assert_eq!(segs, vec![(115, 45), (160, 60), (620, 100), (1120, 5)]);
        assert_eq!(p.total_bytes, 5 + 40 + 60 + 100 + 5);
        assert_eq!(p.tensor_count, 5);
        let first = &p.segments[0].tensors;
        assert_eq!(first.len(), 2);
        assert_eq!(
            first[1],
            TensorSlot {
                name: "big".into(),
                dtype: Dtype::U8,
                shape: vec![40],
                offset: 5,
                len: 40,
                piece: Some(0),
            }
        );
        assert_eq!(first[0].piece, Some(5));
        assert_eq!(p.segments[1].tensors[0].piece, Some(40));
        assert_eq!(p.segments[3].tensors[0].piece, Some(0));
    }

    #[test]
    fn whole_tensors_are_not_pieces() {
        let p = build(vec![shard("a", &[("x", 10)])], None, 100).unwrap();
        assert_eq!(p.segments[0].tensors[0].piece, None);
        assert_eq!(p.segments[0].tensors[0].dtype, Dtype::U8);
        let p = build_parts(vec![shard("a", &[("x", 10)])], &[], 100).unwrap();
        assert!(p.segments.is_empty());
        assert_eq!((p.total_bytes, p.tensor_count), (0, 0));
    }

    #[test]
    fn parts_span_shards_and_may_be_whole_tensors() {
        let parts: Vec<Part> = vec![("x".into(), 0, 10), ("w".into(), 3, 4)];
        let p = build_parts(
            vec![shard("a", &[("x", 10)]), shard("b", &[("w", 8)])],
            &parts,
            100,
        )
        .unwrap();
        let segs: Vec<(usize, u64, u64)> = p
            .segments
            .iter()
            .map(|s| (s.shard, s.start, s.len))
            .collect();
        assert_eq!(segs, vec![(0, 100, 10), (1, 103, 1)]);
    }

    #[test]
    fn rejects_bad_parts() {
        let err = |parts: Vec<Part>| {
            build_parts(vec![shard("a", &[("x", 10)])], &parts, 100).unwrap_err()
        };
        // Which check refused the parts is only in the message.
        let refused = |parts: Vec<Part>| {
            let err = err(parts);
            assert!(
                matches!(err, Error::InvalidOption { ref option, .. } if option == "parts"),
                "{err}"
            );
            err.to_string()
        };
        assert!(refused(vec![("x".into(), 5, 11)]).contains("outside its 10 bytes"));
        assert!(refused(vec![("x".into(), 6, 5)]).contains("outside"));
        assert!(refused(vec![("x".into(), 0, 6), ("x".into(), 5, 10)]).contains("overlap"));
        assert!(matches!(
            err(vec![("nope".into(), 0, 1)]),
            Error::MissingTensors { ref names, .. } if *names == ["nope"]
        ));
    }

    #[test]
    fn splits_blocks() {
        let b: Vec<_> = blocks(0, 10, 4).collect();
        assert_eq!(b, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(blocks(7, 0, 4).count(), 0);
        // Cuts fall on multiples of the block size in the file, not of the range.
        let b: Vec<_> = blocks(6, 10, 4).collect();
        assert_eq!(b, vec![(0, 2), (2, 4), (6, 4)]);
        let b: Vec<_> = blocks(8, 3, 4).collect();
        assert_eq!(b, vec![(0, 3)]);
    }

    #[test]
    fn blocks_on_a_grid_cut_only_between_units() {
        // Units of 10 from offset 7 on (an encrypted file: segment k ≥ 1 at 10k - 3).
        let b: Vec<_> = blocks_on(0, 60, 25, Some((10, 3))).collect();
        assert_eq!(b, vec![(0, 17), (17, 20), (37, 20), (57, 3)]);
        for (start, len, block) in [
            (5u64, 200u64, 25u64),
            (0, 9, 14),
            (33, 77, 100),
            (7, 50, 10),
        ] {
            let b: Vec<_> = blocks_on(start, len, block, Some((10, 3))).collect();
            assert_eq!(b.iter().map(|p| p.1).sum::<u64>(), len);
            assert!(b.iter().all(|p| p.1 <= block));
            for w in b.windows(2) {
                let cut = start + w[1].0;
                assert_eq!((cut + 3) % 10, 0, "{start} {len} {block}: {b:?}");
            }
        }
        assert!(blocks_on(6, 10, 4, None).eq(blocks(6, 10, 4)));
        // Units larger than the block: never a read above the block.
        assert!(blocks_on(6, 100, 4, Some((10, 3))).eq(blocks(6, 100, 4)));
    }
}
