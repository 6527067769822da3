//! The plan of a load shared by the ranks of a process group (`fastload.distributed`): every
//! rank computes the same plan from the same headers. The tensors that any rank wants are laid
//! end to end in file order; their total is cut into one contiguous byte range per rank (a tensor
//! is split where two ranges meet), and each range into chunks of at most `chunk` bytes, one
//! chunk per round of the exchange. Rank r reads the pieces of its own range (as
//! [`crate::plan::build_parts`] byte ranges) and the ranks exchange the rest, round by round.
//!
//! Pure: headers in, plan out. The exchange itself (torch.distributed) stays in Python.

use std::collections::HashSet;

use crate::error::Result;
use crate::format::TensorEntry;
use crate::plan::Part;
use crate::source::Shard;

/// Bytes a rank moves per round at most, and at least (a round costs a collective and a batch
/// of messages: tiny rounds would be all overhead).
pub const MAX_CHUNK: u64 = 64 << 20;
pub const MIN_CHUNK: u64 = 256 << 10;

/// A tensor of the checkpoint, as the plan sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub len: u64,
}

/// Bytes `begin..end` of wanted tensor `tensor` (an index into [`RankPlan::tensors`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub begin: u64,
    pub end: u64,
}

/// The tensors of `shards` in file order, with the checks and errors of a local load: a name in
/// two shards is a format error, a name in `names` that no shard holds is
/// [`crate::Error::MissingTensors`].
pub fn entries(shards: Vec<Shard>, names: Option<&[String]>) -> Result<Vec<TensorEntry>> {
    // The local planner makes exactly these checks; the segments it builds are not used.
    let plan = crate::plan::build(shards, names, u64::MAX)?;
    Ok(plan
        .shards
        .iter()
        .flat_map(|s| s.header.tensors.iter().cloned())
        .collect())
}

/// The bytes one round moves per rank for a memory limit: a quarter of it (reads of the next
/// round overlap this one's exchange), within [`MIN_CHUNK`]..=[`MAX_CHUNK`].
pub fn chunk_for(memory_limit: u64) -> u64 {
    (memory_limit / 4).clamp(MIN_CHUNK, MAX_CHUNK)
}

/// Who reads what, and when.
#[derive(Debug)]
pub struct RankPlan {
    /// Indexes into the table of the tensors some rank wants, in file order.
    pub tensors: Vec<usize>,
    /// Bytes of the wanted tensors, end to end.
    pub total: u64,
    /// Per rank: its byte range of that total.
    pub ranges: Vec<(u64, u64)>,
    /// Rounds of the exchange: the most chunks any rank's range has.
    pub rounds: usize,
    /// `pieces[rank][round]`: the pieces of that rank's chunk, in file order (empty rounds pad
    /// every rank to `rounds`).
    pub pieces: Vec<Vec<Vec<Piece>>>,
    /// Per wanted tensor: the pieces it is cut into.
    pub counts: Vec<usize>,
    /// Per rank, per wanted tensor: whether that rank wants it.
    wanted: Vec<Vec<bool>>,
}

impl RankPlan {
    /// Plans `table` (every tensor, in file order) for ranks whose wanted names are `needs`
    /// (`None`: every tensor), moving at most `chunk` bytes per rank and round.
    pub fn new(table: &[Entry], needs: &[Option<HashSet<String>>], chunk: u64) -> Self {
        let chunk = chunk.max(1);
        let world = needs.len().max(1);
        let wants = |need: &Option<HashSet<String>>, e: &Entry| {
            need.as_ref().is_none_or(|n| n.contains(&e.name))
        };
        let tensors: Vec<usize> = (0..table.len())
            .filter(|&i| needs.iter().any(|n| wants(n, &table[i])))
            .collect();
        let wanted = needs
            .iter()
            .map(|n| tensors.iter().map(|&i| wants(n, &table[i])).collect())
            .collect();
        let mut starts = Vec::with_capacity(tensors.len());
        let mut total = 0u64;
        for &i in &tensors {
            starts.push(total);
            total += table[i].len;
        }
        let bound = |r: usize| (u128::from(total) * r as u128 / world as u128) as u64;
        let ranges: Vec<(u64, u64)> = (0..world).map(|r| (bound(r), bound(r + 1))).collect();
        let rounds = ranges
            .iter()
            .map(|&(s, e)| (e - s).div_ceil(chunk) as usize)
            .max()
            .unwrap_or(0);
        let lens: Vec<u64> = tensors.iter().map(|&i| table[i].len).collect();
        let mut counts = vec![0usize; tensors.len()];
        let pieces = ranges
            .iter()
            .map(|&(start, end)| {
                let mut per_round: Vec<Vec<Piece>> = (start..end)
                    .step_by(chunk as usize)
                    .map(|cs| cut(&starts, &lens, &mut counts, cs, (cs + chunk).min(end)))
                    .collect();
                per_round.resize_with(rounds, Vec::new);
                per_round
            })
            .collect();
        RankPlan {
            tensors,
            total,
            ranges,
            rounds,
            pieces,
            counts,
            wanted,
        }
    }

    /// Whether `rank` wants wanted tensor `tensor`.
    pub fn wants(&self, rank: usize, tensor: usize) -> bool {
        self.wanted
            .get(rank)
            .and_then(|w| w.get(tensor))
            .copied()
            .unwrap_or(false)
    }

    /// What `rank` reads from storage, every round's pieces in order, as byte ranges of named
    /// tensors for [`crate::plan::build_parts`].
    pub fn parts(&self, rank: usize, table: &[Entry]) -> Vec<Part> {
        self.pieces
            .get(rank)
            .into_iter()
            .flatten()
            .flatten()
            .map(|p| (table[self.tensors[p.tensor]].name.clone(), p.begin, p.end))
            .collect()
    }
}

/// The pieces of bytes `pos..end` of the wanted tensors laid end to end (`starts`, `lens`).
fn cut(starts: &[u64], lens: &[u64], counts: &mut [usize], mut pos: u64, end: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut i = starts.partition_point(|&s| s <= pos).saturating_sub(1);
    while pos < end {
        let (t0, n) = (starts[i], lens[i]);
        if pos >= t0 + n {
            i += 1; // an empty tensor, or the end of the previous one
            continue;
        }
        let hi = end.min(t0 + n);
        out.push(Piece {
            tensor: i,
            begin: pos - t0,
            end: hi - t0,
        });
        counts[i] += 1;
        pos = hi;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Vec<Entry> {
        [("a", 12), ("e", 0), ("big", 1000), ("b", 8), ("c", 5)]
            .into_iter()
            .map(|(name, len)| Entry {
                name: name.into(),
                len,
            })
            .collect()
    }

    #[test]
    fn splits_bytes_evenly_and_covers_each_byte_once() {
        let table = table();
        for world in [1usize, 2, 3, 4, 7] {
            let plan = RankPlan::new(&table, &vec![None; world], 64);
            assert_eq!(plan.total, 1025);
            let sizes: Vec<u64> = plan.ranges.iter().map(|(s, e)| e - s).collect();
            assert_eq!(sizes.iter().sum::<u64>(), 1025);
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
            let mut covered: Vec<Vec<(u64, u64)>> = vec![Vec::new(); plan.tensors.len()];
            for rounds in &plan.pieces {
                assert_eq!(rounds.len(), plan.rounds);
                for pieces in rounds {
                    assert!(pieces.iter().map(|p| p.end - p.begin).sum::<u64>() <= 64);
                    for p in pieces {
                        covered[p.tensor].push((p.begin, p.end));
                    }
                }
            }
            for (i, spans) in covered.iter_mut().enumerate() {
                spans.sort_unstable();
                let len = table[plan.tensors[i]].len;
                assert_eq!(spans.iter().map(|(lo, hi)| hi - lo).sum::<u64>(), len);
                assert!(spans.windows(2).all(|w| w[0].1 == w[1].0));
                assert_eq!(plan.counts[i], spans.len());
            }
        }
    }

    #[test]
    fn plans_only_wanted_tensors_and_knows_who_wants_them() {
        let table = table();
        let needs = vec![
            Some(HashSet::from(["a".to_string()])),
            Some(HashSet::from(["c".to_string()])),
        ];
        let plan = RankPlan::new(&table, &needs, 64);
        let names: Vec<&str> = plan
            .tensors
            .iter()
            .map(|&i| table[i].name.as_str())
            .collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(plan.total, 17);
        assert!(plan.wants(0, 0) && !plan.wants(0, 1) && plan.wants(1, 1));
        // Rank 0 reads bytes 0..8 of the 17 (in "a"), rank 1 the rest: a's tail and all of c.
        assert_eq!(plan.parts(0, &table), vec![("a".to_string(), 0, 8)]);
        assert_eq!(
            plan.parts(1, &table),
            vec![("a".to_string(), 8, 12), ("c".to_string(), 0, 5)]
        );
    }

    #[test]
    fn an_empty_plan_has_no_rounds() {
        let table = table();
        let plan = RankPlan::new(&table, &[Some(HashSet::new()), Some(HashSet::new())], 64);
        assert!(plan.tensors.is_empty());
        assert_eq!((plan.total, plan.rounds), (0, 0));
        assert!(plan.pieces.iter().all(Vec::is_empty));
    }

    #[test]
    fn chunks_follow_the_memory_limit_within_bounds() {
        assert_eq!(chunk_for(1 << 20), MIN_CHUNK);
        assert_eq!(chunk_for(64 << 20), 16 << 20);
        assert_eq!(chunk_for(1 << 40), MAX_CHUNK);
    }
}
