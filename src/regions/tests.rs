use super::*;

fn s(start: Option<i128>, stop: Option<i128>, step: Option<i128>) -> Item {
    Item::Slice { start, stop, step }
}

const ALL: Item = Item::Slice {
    start: None,
    stop: None,
    step: None,
};

/// Every element offset (in elements) a normalised region selects, in C order, by walking it.
fn elements(dims: &[Dim], shape: &[u64]) -> Vec<u64> {
    let strides: Vec<u64> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    let mut out = vec![0u64];
    let mut dim = 0;
    for d in dims {
        let picks: Vec<u64> = match *d {
            Dim::New => continue,
            Dim::Pick(i) => vec![i * strides[dim]],
            Dim::Range { start, step, count } => (0..count)
                .map(|k| (start + k * step) * strides[dim])
                .collect(),
        };
        out = out
            .iter()
            .flat_map(|o| picks.iter().map(move |p| o + p))
            .collect();
        dim += 1;
    }
    out
}

/// The elements a plan's runs hold, viewed by its size and strides, in C order.
fn viewed(p: &Plan, itemsize: u64) -> Vec<u64> {
    // Each buffer position -> the tensor element it holds.
    let mut buffer = Vec::new();
    for &(o, n) in &p.runs {
        buffer.extend((0..n / itemsize).map(|k| o / itemsize + k));
    }
    let mut at = vec![0u64];
    for (n, st) in p.size.iter().zip(&p.stride) {
        at = at
            .iter()
            .flat_map(|a| (0..*n).map(move |k| a + k * st))
            .collect();
    }
    at.into_iter().map(|i| buffer[i as usize]).collect()
}

#[test]
fn normalize_follows_python_ranges() {
    let shape = [4, 3];
    let dims = normalize(&[Item::Int(-1), s(Some(-2), None, None)], &shape, true).unwrap();
    assert_eq!(
        dims,
        vec![
            Dim::Pick(3),
            Dim::Range {
                start: 1,
                step: 1,
                count: 2
            }
        ]
    );
    // Bounds and steps past int64 clamp as Python's do.
    let huge = normalize(
        &[s(Some(i128::MIN), Some(i128::MAX), Some(1 << 64))],
        &shape,
        true,
    );
    assert_eq!(
        huge.unwrap()[0],
        Dim::Range {
            start: 0,
            step: 4,
            count: 1
        }
    );
    let dims = normalize(&[Item::Ellipsis, Item::New, Item::Int(0)], &shape, true).unwrap();
    assert_eq!(dims.len(), 3);
    assert_eq!(shape_of(&dims), vec![4, 1]);
}

#[test]
fn normalize_refuses_in_the_order_parts_reports() {
    let shape = [4, 3];
    let n = |items: &[Item]| normalize(items, &shape, false).unwrap_err();
    assert_eq!(n(&[Item::Int(9), Item::Other]), Refused::Item(1));
    assert_eq!(n(&[s(None, None, Some(0)), Item::Other]), Refused::Step(0));
    assert_eq!(n(&[Item::New]), Refused::Item(0));
    assert_eq!(n(&[Item::Ellipsis, Item::Ellipsis]), Refused::Ellipses);
    assert_eq!(n(&[ALL, ALL, ALL]), Refused::TooMany { used: 3 });
    assert_eq!(
        n(&[Item::Int(4), Item::Int(7)]),
        Refused::OutOfRange { at: 0, dim: 0 }
    );
    assert_eq!(
        n(&[Item::Ellipsis, Item::Int(-4)]),
        Refused::OutOfRange { at: 1, dim: 1 }
    );
}

#[test]
fn plans_read_exactly_the_selected_elements() {
    let shape = [5, 4, 6];
    let indices: Vec<Vec<Item>> = vec![
        vec![s(Some(1), Some(4), None)],
        vec![ALL, s(Some(1), Some(3), None)],
        vec![
            Item::Int(2),
            Item::New,
            s(None, None, Some(2)),
            Item::Int(-1),
        ],
        vec![
            s(None, None, Some(3)),
            Item::Ellipsis,
            s(Some(5), None, None),
        ],
        vec![],
    ];
    for items in &indices {
        for cost in [0, 16, LOCAL, 1 << 62] {
            let dims = normalize(items, &shape, true).unwrap();
            let p = plan(&dims, &shape, 2, cost).unwrap();
            let mut want = elements(&dims, &shape);
            let got = viewed(&p, 2);
            assert_eq!(got, want, "{items:?} cost {cost}");
            // Runs are increasing and disjoint.
            assert!(p.runs.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
            want.sort_unstable();
            assert!(p.bytes() >= 2 * want.len() as u64);
        }
    }
}

const LOCAL: u64 = 16 * 1024;

#[test]
fn a_column_slice_is_a_run_per_row_or_one_span() {
    // 16 rows of 8 bf16: columns 6..8.
    let shape = [16, 8];
    let dims = normalize(&[ALL, s(Some(6), Some(8), None)], &shape, true).unwrap();
    let per_row = plan(&dims, &shape, 2, 0).unwrap();
    assert_eq!(per_row.runs.len(), 16);
    assert_eq!(per_row.runs[1], (16 + 12, 4));
    assert_eq!(per_row.lead, 1);
    let span = plan(&dims, &shape, 2, LOCAL).unwrap();
    assert_eq!(span.runs, vec![(12, 15 * 16 + 4)]);
    assert_eq!(span.lead, 0);
}

#[test]
fn empty_regions_have_no_plan_but_a_shape() {
    let shape = [0, 1 << 62, 1 << 62];
    let dims = normalize(&[Item::Ellipsis, Item::New], &shape, true).unwrap();
    assert_eq!(shape_of(&dims), vec![0, 1 << 62, 1 << 62, 1]);
    assert!(plan(&dims, &shape, 4, LOCAL).is_none());
}

fn merge_of(read_cost: u64, span_max: u64) -> Merge {
    Merge {
        read_cost,
        spans: true,
        waste: 0.1,
        spans_win: 2.0,
        span_max,
    }
}

#[test]
fn merge_groups_every_run_once() {
    let runs: Vec<(u64, u64)> = (0..100).map(|i| (i * 8192, 4096)).collect();
    // Rows narrower than a request's cost: spans.
    let groups = merge(&runs, &merge_of(512 * 1024, 64 << 20));
    assert_eq!(groups, vec![(0, 100)]);
    // Bounded by span_max.
    let groups = merge(&runs, &merge_of(512 * 1024, 100 * 1024));
    assert!(groups.len() > 1);
    assert_eq!(groups.iter().map(|g| g.1).sum::<usize>(), 100);
    let mut next = 0;
    for &(first, count) in &groups {
        assert_eq!(first, next);
        let last = runs[first + count - 1];
        assert!(count == 1 || last.0 + last.1 - runs[first].0 <= 100 * 1024);
        next = first + count;
    }
    // A request cheaper than the gaps: a read per run.
    assert_eq!(merge(&runs, &merge_of(1024, 64 << 20)).len(), 100);
    // Touching runs always merge.
    let touching = [(0, 10), (10, 10), (20, 5)];
    assert_eq!(merge(&touching, &merge_of(0, 64 << 20)), vec![(0, 3)]);
}

#[test]
fn strips_describe_evenly_spaced_runs() {
    let runs = [(0, 4), (16, 4), (32, 4), (100, 4)];
    assert_eq!(strips(&runs, 0, 4, 2), vec![(0, 3, 8, 0), (3, 1, 0, 50)]);
}

#[test]
fn the_planner_plans_each_region_once() {
    let planner = Planner::new(2);
    let shape = [8, 8];
    let dims = normalize(&[s(Some(1), Some(3), None)], &shape, true).unwrap();
    let a = planner.reads(&dims, &shape, 4, LOCAL, None).unwrap();
    let b = planner.reads(&dims, &shape, 4, LOCAL, None).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let other = planner.reads(&dims, &shape, 4, 0, None).unwrap();
    assert!(!Arc::ptr_eq(&a, &other));
    assert_eq!(a.plan, other.plan);
}
