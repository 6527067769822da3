//! Regions of a tensor: which bytes of a C-contiguous tensor `tensor[index]` needs, for every
//! reader that reads less than a whole tensor (`safe_open(...).get_slice(name)[index]`, the
//! engines' lazy tensors, `parts=` loads, transformers' tensor-parallel slices).
//!
//! Three steps, each a pure function: [`normalize`] turns a basic index (ints, slices with
//! positive steps, one `...`, `None`s) into one [`Dim`] per dim of the result's source, as
//! Python's `range` arithmetic does (which clamps bounds as torch does, without torch's overflow
//! near 2**63); [`plan`] picks the runs (byte ranges) to read and how the bytes read view as the
//! region; [`merge`] groups runs into reads, spanning gaps cheaper to read than another request.
//! What a request costs ([`Plan`]'s `read_cost`) is the source's: `Source::read_cost`.
//!
//! [`Planner`] keeps plans by region: a model's layers repeat their shapes and a loader's
//! indices, so a load plans a few dozen distinct regions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One entry of an index as given (Python's ints are clamped to `i128`, past which none of them
/// means anything else).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Item {
    Int(i128),
    Slice {
        start: Option<i128>,
        stop: Option<i128>,
        step: Option<i128>,
    },
    Ellipsis,
    /// `None`: a dim of 1 added.
    New,
    /// Anything else (a list, a tensor, a bool, a slice of non-ints): not a basic index.
    Other,
}

/// One entry of a normalised index: a dim picked at one index (dropped), a dim's indices
/// `start, start + step, ...` (`count` of them), or a dim of 1 added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Pick(u64),
    Range { start: u64, step: u64, count: u64 },
    New,
}

/// Why an index is not a region [`normalize`] describes; positions are of the index's items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The item at this position is not an int, a slice of ints, `...` (or `None`, where not
    /// allowed).
    Item(usize),
    /// The slice at this position has a step below 1.
    Step(usize),
    /// More than one `...`.
    Ellipses,
    /// More ints and slices than the tensor has dims.
    TooMany { used: usize },
    /// The int at this position is outside its dim (`dim`).
    OutOfRange { at: usize, dim: usize },
}

/// `items` as one [`Dim`] per dim of a tensor of `shape` (ints made non-negative, `...`
/// expanded, missing trailing dims whole) plus [`Dim::New`] for each `None` (refused unless
/// `allow_new`). Structural problems are found first, in the items' order, then ints out of
/// range, in the dims' order.
pub fn normalize(items: &[Item], shape: &[u64], allow_new: bool) -> Result<Vec<Dim>, Refused> {
    let mut ellipses = 0;
    for (at, it) in items.iter().enumerate() {
        match *it {
            Item::Other => return Err(Refused::Item(at)),
            Item::New if !allow_new => return Err(Refused::Item(at)),
            Item::Slice { step: Some(s), .. } if s < 1 => return Err(Refused::Step(at)),
            Item::Ellipsis => ellipses += 1,
            _ => {}
        }
    }
    if ellipses > 1 {
        return Err(Refused::Ellipses);
    }
    let used = items
        .iter()
        .filter(|it| matches!(it, Item::Int(_) | Item::Slice { .. }))
        .count();
    if used > shape.len() {
        return Err(Refused::TooMany { used });
    }
    let whole = Item::Slice {
        start: None,
        stop: None,
        step: None,
    };
    let mut expanded: Vec<(usize, Item)> = Vec::with_capacity(shape.len() + items.len());
    for (at, it) in items.iter().enumerate() {
        if *it == Item::Ellipsis {
            expanded.extend(std::iter::repeat_n((at, whole), shape.len() - used));
        } else {
            expanded.push((at, *it));
        }
    }
    if ellipses == 0 {
        expanded.extend(std::iter::repeat_n(
            (items.len(), whole),
            shape.len() - used,
        ));
    }
    let mut out = Vec::with_capacity(expanded.len());
    let mut dim = 0;
    for (at, it) in expanded {
        let n = if matches!(it, Item::New) {
            0
        } else {
            shape[dim]
        };
        out.push(match it {
            Item::New => Dim::New,
            Item::Int(i) => {
                let size = i128::from(n);
                if i < -size || i >= size {
                    return Err(Refused::OutOfRange { at, dim });
                }
                Dim::Pick((if i < 0 { i + size } else { i }) as u64)
            }
            Item::Slice { start, stop, step } => range(start, stop, step.unwrap_or(1), n),
            Item::Ellipsis | Item::Other => unreachable!("refused or expanded above"),
        });
        dim += usize::from(!matches!(it, Item::New));
    }
    Ok(out)
}

/// Python's `slice(start, stop, step).indices(n)` and its length, for `step >= 1`.
fn range(start: Option<i128>, stop: Option<i128>, step: i128, n: u64) -> Dim {
    let size = i128::from(n);
    let clamp = |v: Option<i128>, default: i128| match v {
        None => default,
        Some(v) if v < 0 => (v + size).max(0),
        Some(v) => v.min(size),
    };
    let (start, stop) = (clamp(start, 0), clamp(stop, size));
    let count = if stop > start {
        (stop - start - 1) / step + 1
    } else {
        0
    };
    Dim::Range {
        start: start as u64,
        // Never past the dim (one element at most then): the same indices, and no overflow.
        step: step.min(size.max(1)) as u64,
        count: count as u64,
    }
}

/// The shape of `tensor[index]` for a normalised index.
pub fn shape_of(dims: &[Dim]) -> Vec<u64> {
    dims.iter()
        .filter_map(|d| match *d {
            Dim::Pick(_) => None,
            Dim::Range { count, .. } => Some(count),
            Dim::New => Some(1),
        })
        .collect()
}

/// How the box a plan reads views as the region: each dim of the box kept whole, dropped (an
/// int: its one index), or a dim of 1 added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    All,
    Drop,
    New,
}

/// How a region is read: `runs` (`(offset, len)` in bytes from the tensor's start, increasing
/// and disjoint) land one after the other in a buffer that `size` and `stride` (in elements)
/// view as the selected box, which `view` turns into the region; `lead` dims of the box pick the
/// run (the rest lie within one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub runs: Vec<(u64, u64)>,
    pub size: Vec<u64>,
    pub stride: Vec<u64>,
    pub view: Vec<View>,
    pub lead: usize,
}

impl Plan {
    /// The bytes the runs hold.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.1).sum()
    }
}

/// What each dim of a region selects, in the box's dims: `(start, step, count)`.
fn selected(dims: &[Dim]) -> Vec<(u64, u64, u64)> {
    dims.iter()
        .filter_map(|d| match *d {
            Dim::Pick(i) => Some((i, 1, 1)),
            // One element: its step is no stride.
            Dim::Range { start, step, count } => {
                Some((start, if count > 1 { step } else { 1 }, count))
            }
            Dim::New => None,
        })
        .collect()
}

/// The runs of a C-contiguous tensor of `shape` and `itemsize` bytes an element that a
/// normalised region needs, and how to view them; `None` when it selects nothing.
///
/// Dims before a "run" dim `r` are walked index by index (only the selected ones); from `r`
/// inwards each run is read whole, from the first selected element to the last (the elements
/// between them at steps or in other rows are read too). `r` is the one that reads the fewest
/// bytes plus `read_cost` per run (the outermost on a tie): a dim-0 slice is one run, `[:, a:b]`
/// either a run per row or one run across the rows it spans.
pub fn plan(dims: &[Dim], shape: &[u64], itemsize: u64, read_cost: u64) -> Option<Plan> {
    let sel = selected(dims);
    if sel.iter().any(|s| s.2 == 0) {
        return None;
    }
    let ndim = shape.len();
    // Elements from one index of each dim to the next (saturating: a box with an element in it
    // is within a file's size, nothing saturates there).
    let mut strides = vec![1u128; ndim];
    for d in (0..ndim.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(u128::from(shape[d + 1]));
    }
    let item = u128::from(itemsize);
    let r = run_dim(&sel, &strides, item, read_cost);
    let span = span_from(&sel, &strides, r);
    let first: u128 = (r..ndim).map(|d| u128::from(sel[d].0) * strides[d]).sum();
    let mut offsets = vec![first];
    for d in 0..r {
        let (start, step, count) = sel[d];
        let picks: Vec<u128> = (0..count)
            .map(|k| u128::from(start + k * step) * strides[d])
            .collect();
        offsets = offsets
            .iter()
            .flat_map(|o| picks.iter().map(move |p| o + p))
            .collect();
    }
    let runs = offsets
        .into_iter()
        .map(|o| ((o * item) as u64, (span * item) as u64))
        .collect();
    let mut stride = vec![0u64; ndim];
    let mut inner = span;
    for d in (0..r).rev() {
        stride[d] = inner as u64;
        inner *= u128::from(sel[d].2);
    }
    for d in r..ndim {
        stride[d] = (u128::from(sel[d].1) * strides[d]) as u64;
    }
    let view = dims
        .iter()
        .map(|d| match d {
            Dim::Pick(_) => View::Drop,
            Dim::Range { .. } => View::All,
            Dim::New => View::New,
        })
        .collect();
    let size: Vec<u64> = sel.iter().map(|s| s.2).collect();
    let lead = lead_dims(&size, runs_before(&sel, r));
    Some(Plan {
        runs,
        size,
        stride,
        view,
        lead,
    })
}

/// Elements from the first selected element of dims `r..` to the last, plus one: a run's.
fn span_from(sel: &[(u64, u64, u64)], strides: &[u128], r: usize) -> u128 {
    (r..sel.len()).fold(1u128, |acc, d| {
        let (_, step, count) = sel[d];
        let reach = u128::from(count - 1).saturating_mul(u128::from(step));
        acc.saturating_add(reach.saturating_mul(strides[d]))
    })
}

/// The runs when dims before `r` are walked index by index.
fn runs_before(sel: &[(u64, u64, u64)], r: usize) -> u128 {
    sel[..r]
        .iter()
        .fold(1u128, |acc, s| acc.saturating_mul(u128::from(s.2)))
}

/// The run dim: the one that reads the fewest bytes plus `read_cost` per run (the outermost
/// on a tie; 0 for a scalar).
fn run_dim(sel: &[(u64, u64, u64)], strides: &[u128], item: u128, read_cost: u64) -> usize {
    let mut best: Option<(u128, usize)> = None;
    for r in (0..sel.len().max(1)).rev() {
        let r = r.min(sel.len());
        let per_run = span_from(sel, strides, r)
            .saturating_mul(item)
            .saturating_add(u128::from(read_cost));
        let cost = runs_before(sel, r).saturating_mul(per_run);
        if best.is_none_or(|(c, _)| cost <= c) {
            best = Some((cost, r));
        }
    }
    best.map_or(0, |b| b.1)
}

/// How many leading dims of `size` the runs walk: the smallest prefix whose product is the
/// number of runs (dims of 1 change nothing).
fn lead_dims(size: &[u64], runs: u128) -> usize {
    let mut product = 1u128;
    for (d, &n) in size.iter().enumerate() {
        if product == runs {
            return d;
        }
        product *= u128::from(n);
    }
    size.len()
}

/// What [`merge`] decides with: what one more read costs, in bytes one could read instead;
/// whether reads beyond `waste` may be chosen when they save enough of it (`spans`); the share
/// of a part's bytes that merging may always add (`waste`); how much cheaper spans must be
/// (`spans_win`); the longest read that crosses gaps (`span_max`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Merge {
    pub read_cost: u64,
    pub spans: bool,
    pub waste: f64,
    pub spans_win: f64,
    pub span_max: u64,
}

/// The reads of `runs` (`(offset, len)`, increasing, disjoint): each a `(first run, runs)`
/// group of consecutive runs, read as one range from the first's start to the last's end.
///
/// A gap is worth reading when it is smaller than a read (`read_cost`). Within `waste`: such
/// gaps of at most `waste` of the run before them (touching runs always merge). Spans (`spans`):
/// every such gap, when that costs `spans_win` times less (bytes plus `read_cost` per read) than
/// the first: a column slice of rows narrower than a read's cost is a few reads of the rows it
/// crosses, not a read per row. A read that crosses gaps is at most `span_max` bytes.
pub fn merge(runs: &[(u64, u64)], m: &Merge) -> Vec<(usize, usize)> {
    let n = runs.len();
    if n <= 1 {
        return if n == 1 { vec![(0, 1)] } else { Vec::new() };
    }
    let gaps: Vec<u64> = runs
        .windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].0 + w[0].1))
        .collect();
    let small: Vec<bool> = gaps.iter().map(|&g| g == 0 || g < m.read_cost).collect();
    let within = |i: usize| small[i] && (gaps[i] as f64) <= m.waste * runs[i].1 as f64;
    let mut merged: Vec<bool> = (0..n - 1).map(within).collect();
    let (n_small, n_merged) = (count(&small), count(&merged));
    if m.spans && n_small > n_merged {
        let need: u128 = runs.iter().map(|r| u128::from(r.1)).sum();
        let gap_sum = |keep: &[bool]| -> u128 {
            (0..n - 1)
                .filter(|&i| keep[i])
                .map(|i| u128::from(gaps[i]))
                .sum()
        };
        let read = u128::from(m.read_cost);
        let cost_within = need + gap_sum(&merged) + (n - n_merged) as u128 * read;
        let cost_spans = need + gap_sum(&small) + (n - n_small) as u128 * read;
        if cost_spans as f64 * m.spans_win <= cost_within as f64 {
            merged = small;
        }
    }
    let mut groups = Vec::new();
    let mut first = 0;
    for i in 0..n - 1 {
        let end = runs[i + 1].0 + runs[i + 1].1;
        if !merged[i] || (gaps[i] != 0 && end - runs[first].0 > m.span_max) {
            groups.push((first, i + 1 - first));
            first = i + 1;
        }
    }
    groups.push((first, n - first));
    groups
}

fn count(flags: &[bool]) -> usize {
    flags.iter().filter(|&&f| f).count()
}

/// Runs `first .. first + count` of one read as strips of runs evenly apart: `(first run, runs,
/// elements from one run to the next, first run's element in the read)`; one strip for the
/// rows of a 2-d slice, one per outer index else.
pub fn strips(
    runs: &[(u64, u64)],
    first: usize,
    count: usize,
    itemsize: u64,
) -> Vec<(usize, usize, u64, u64)> {
    let base = runs[first].0;
    let end = first + count;
    let mut out = Vec::new();
    let mut j = first;
    while j < end {
        let (mut k, mut step) = (j + 1, 0);
        if k < end {
            step = runs[k].0 - runs[j].0;
            while k + 1 < end && runs[k + 1].0 - runs[k].0 == step {
                k += 1;
            }
            k += 1;
        }
        out.push((j, k - j, step / itemsize, (runs[j].0 - base) / itemsize));
        j = k;
    }
    out
}

/// A region's plan with its reads: each `(begin, end)` within the tensor, and the strips of its
/// runs ([`strips`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Reads {
    pub plan: Plan,
    pub reads: Vec<(u64, u64)>,
    pub strips: Vec<Vec<(usize, usize, u64, u64)>>,
}

/// [`plan`] (with `read_cost`) and the reads [`merge`] makes of its runs (`None`: no merging,
/// a read per run).
pub fn plan_reads(
    dims: &[Dim],
    shape: &[u64],
    itemsize: u64,
    read_cost: u64,
    m: Option<&Merge>,
) -> Option<Reads> {
    let plan = plan(dims, shape, itemsize, read_cost)?;
    let groups = match m {
        Some(m) => merge(&plan.runs, m),
        None => (0..plan.runs.len()).map(|i| (i, 1)).collect(),
    };
    let mut reads = Vec::with_capacity(groups.len());
    let mut all = Vec::with_capacity(groups.len());
    for (first, count) in groups {
        let last = plan.runs[first + count - 1];
        reads.push((plan.runs[first].0, last.0 + last.1));
        all.push(strips(&plan.runs, first, count, itemsize));
    }
    Some(Reads {
        plan,
        reads,
        strips: all,
    })
}

/// What a plan depends on: the tensor, the region, the read cost and the merge settings.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    shape: Vec<u64>,
    itemsize: u64,
    dims: Vec<Dim>,
    read_cost: u64,
    merge: Option<(u64, bool, u64, u64, u64)>,
}

/// Plans by region (see the module's doc); emptied once it holds `limit` of them.
pub struct Planner {
    plans: Mutex<HashMap<Key, Option<Arc<Reads>>>>,
    limit: usize,
}

impl Planner {
    pub fn new(limit: usize) -> Self {
        Planner {
            plans: Mutex::new(HashMap::new()),
            limit,
        }
    }

    /// [`plan_reads`], planned once per distinct region.
    pub fn reads(
        &self,
        dims: &[Dim],
        shape: &[u64],
        itemsize: u64,
        read_cost: u64,
        m: Option<&Merge>,
    ) -> Option<Arc<Reads>> {
        let key = Key {
            shape: shape.to_vec(),
            itemsize,
            dims: dims.to_vec(),
            read_cost,
            merge: m.map(|m| {
                let (w, s) = (m.waste.to_bits(), m.spans_win.to_bits());
                (m.read_cost, m.spans, w, s, m.span_max)
            }),
        };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(got) = plans.get(&key) {
            return got.clone();
        }
        let got = plan_reads(dims, shape, itemsize, read_cost, m).map(Arc::new);
        if plans.len() >= self.limit {
            plans.clear();
        }
        plans.insert(key, got.clone());
        got
    }
}

/// The process's plans, shared by every reader.
pub fn planner() -> &'static Planner {
    static PLANNER: std::sync::OnceLock<Planner> = std::sync::OnceLock::new();
    // A load plans a few dozen distinct regions; a process that loads many models stays bounded.
    PLANNER.get_or_init(|| Planner::new(4096))
}

#[cfg(test)]
mod tests;
