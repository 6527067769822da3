//! Fuzzes the planner of tensor regions: for any shape (small, so that the elements can be
//! walked) and any index, `normalize` never panics, and every plan reads exactly the elements
//! the region selects (viewed through its size and strides), in increasing disjoint runs; the
//! reads `merge` makes cover every run once.
//!
//! Input layout: a byte of dims (0-3) and one of element size, a byte a dim (0-7), 8 bytes of
//! read cost, then items of 1 + 3 x 8 bytes (kind, three values), at most 5.

#![no_main]

use fastload::regions::{self, Dim, Item, Merge};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((shape, itemsize, cost, items)) = decode(data) else {
        return;
    };
    let Ok(dims) = regions::normalize(&items, &shape, true) else {
        return;
    };
    let Some(plan) = regions::plan(&dims, &shape, itemsize, cost) else {
        assert!(regions::shape_of(&dims).contains(&0) || shape.contains(&0));
        return;
    };
    assert!(plan.runs.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
    assert_eq!(viewed(&plan, itemsize), selected(&dims, &shape));
    let merge = Merge {
        read_cost: cost,
        spans: true,
        waste: 0.1,
        spans_win: 2.0,
        span_max: 256,
    };
    let groups = regions::merge(&plan.runs, &merge);
    let mut next = 0;
    for (first, count) in groups {
        assert_eq!(first, next);
        assert!(count >= 1);
        next += count;
    }
    assert_eq!(next, plan.runs.len());
});

fn word(b: &[u8]) -> i128 {
    i128::from(i64::from_le_bytes(b.try_into().unwrap()))
}

fn decode(data: &[u8]) -> Option<(Vec<u64>, u64, u64, Vec<Item>)> {
    let (&ndim, rest) = data.split_first()?;
    let (&size, rest) = rest.split_first()?;
    let ndim = usize::from(ndim % 4);
    let itemsize = [1, 2, 4, 8][usize::from(size % 4)];
    let shape: Vec<u64> = rest.get(..ndim)?.iter().map(|&n| u64::from(n % 8)).collect();
    let rest = &rest[ndim..];
    let cost = u64::from_le_bytes(rest.get(..8)?.try_into().unwrap()) % (1 << 20);
    let items = rest[8..]
        .chunks_exact(25)
        .take(5)
        .map(|c| {
            let opt = |v: i128| (v % 3 != 0).then_some(v / 3);
            let (a, b, s) = (word(&c[1..9]), word(&c[9..17]), word(&c[17..25]));
            match c[0] % 5 {
                0 => Item::Int(a % 16),
                1 => Item::Slice {
                    start: opt(a),
                    stop: opt(b),
                    step: opt(s),
                },
                2 => Item::Ellipsis,
                3 => Item::New,
                _ => Item::Other,
            }
        })
        .collect();
    Some((shape, itemsize, cost, items))
}

/// The element offsets a region selects, in C order.
fn selected(dims: &[Dim], shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0u64];
    let mut dim = 0;
    for d in dims {
        let stride: u64 = shape[dim.min(shape.len())..].iter().skip(1).product();
        let picks: Vec<u64> = match *d {
            Dim::New => continue,
            Dim::Pick(i) => vec![i * stride],
            Dim::Range { start, step, count } => {
                (0..count).map(|k| (start + k * step) * stride).collect()
            }
        };
        out = out.iter().flat_map(|o| picks.iter().map(move |p| o + p)).collect();
        dim += 1;
    }
    out
}

/// The elements a plan's runs hold, viewed by its size and strides, in C order.
fn viewed(p: &regions::Plan, itemsize: u64) -> Vec<u64> {
    let mut buffer = Vec::new();
    for &(o, n) in &p.runs {
        buffer.extend((0..n / itemsize).map(|k| o / itemsize + k));
    }
    let mut at = vec![0u64];
    for (n, st) in p.size.iter().zip(&p.stride) {
        at = at.iter().flat_map(|a| (0..*n).map(move |k| a + k * st)).collect();
    }
    at.into_iter().map(|i| buffer[i as usize]).collect()
}
