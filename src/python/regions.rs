//! `_fastload.plan_region`: a Python index of a tensor as the region `crate::regions` plans
//! (its shape, its runs, its reads), or why it is not one.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyEllipsis, PyInt, PyList, PySlice, PyTuple};

use crate::regions::{self, Dim, Item, Merge, Reads, Refused, View};

/// An int as `i128`, a Python int past it saturated (past 2**127 no int means anything else).
fn int(ob: &Bound<'_, PyAny>) -> PyResult<i128> {
    match ob.extract::<i128>() {
        Ok(v) => Ok(v),
        Err(_) if ob.gt(0)? => Ok(i128::MAX),
        Err(_) => Ok(i128::MIN),
    }
}

/// A bound of a slice: `None`, an int (not a bool), or `Err(())` for anything else.
fn bound(ob: Option<Bound<'_, PyAny>>) -> PyResult<Result<Option<i128>, ()>> {
    match ob {
        None => Ok(Ok(None)),
        Some(v) if v.is_none() => Ok(Ok(None)),
        Some(v) if v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>() => {
            Ok(Ok(Some(int(&v)?)))
        }
        Some(_) => Ok(Err(())),
    }
}

fn item(ob: &Bound<'_, PyAny>) -> PyResult<Item> {
    if ob.is_none() {
        return Ok(Item::New);
    }
    if ob.is_instance_of::<PyEllipsis>() {
        return Ok(Item::Ellipsis);
    }
    if ob.is_instance_of::<PyBool>() {
        return Ok(Item::Other);
    }
    if ob.is_instance_of::<PyInt>() {
        return Ok(Item::Int(int(ob)?));
    }
    if let Ok(s) = ob.cast::<PySlice>() {
        let get = |name: &str| s.getattr(name).ok();
        let (start, stop, step) = (
            bound(get("start"))?,
            bound(get("stop"))?,
            bound(get("step"))?,
        );
        if let (Ok(start), Ok(stop), Ok(step)) = (start, stop, step) {
            return Ok(Item::Slice { start, stop, step });
        }
    }
    Ok(Item::Other)
}

/// The items of a Python index: a tuple's, else the one item it is.
fn items(index: &Bound<'_, PyAny>) -> PyResult<Vec<Item>> {
    match index.cast::<PyTuple>() {
        Ok(t) => t.iter().map(|it| item(&it)).collect(),
        Err(_) => Ok(vec![item(index)?]),
    }
}

/// A region of a tensor: `refused` (why the index is not one: `(kind, item position, dim)`,
/// kind one of "item", "step", "ellipses", "too_many", "out_of_range"), else its `shape` and,
/// unless it selects nothing (`empty`), its plan.
#[pyclass(module = "fastload._fastload", frozen)]
pub struct Region {
    refused: Option<(&'static str, usize, Option<usize>)>,
    shape: Vec<u64>,
    reads: Option<Arc<Reads>>,
}

impl Region {
    fn plan(&self) -> PyResult<&Arc<Reads>> {
        self.reads.as_ref().ok_or_else(|| {
            crate::Error::option("index", "the region has no plan (refused or empty)").into()
        })
    }
}

#[pymethods]
impl Region {
    #[getter]
    fn refused(&self) -> Option<(&'static str, usize, Option<usize>)> {
        self.refused
    }

    /// The shape of `tensor[index]`.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Whether the region selects no element (nothing to read).
    #[getter]
    fn empty(&self) -> bool {
        self.reads.is_none()
    }

    /// The runs to read, `(offset, len)` in bytes from the tensor's start.
    #[getter]
    fn runs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.plan()?.plan.runs)
    }

    /// The runs as file ranges: `(at + offset, len)`.
    fn ranges_at<'py>(&self, py: Python<'py>, at: u64) -> PyResult<Bound<'py, PyList>> {
        let runs = self.plan()?.plan.runs.iter().map(|&(o, n)| (at + o, n));
        PyList::new(py, runs)
    }

    /// The bytes the runs hold.
    #[getter]
    fn bytes(&self) -> PyResult<u64> {
        Ok(self.plan()?.plan.bytes())
    }

    /// The box the runs hold, in elements: its size and strides in the buffer they land in.
    #[getter]
    fn size<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.plan()?.plan.size)
    }

    #[getter]
    fn stride<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.plan()?.plan.stride)
    }

    /// What indexes the box into the region (`slice(None)` kept, `0` dropped, `None` added);
    /// `None` where it is the box itself.
    #[getter]
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let view = &self.plan()?.plan.view;
        if view.iter().all(|v| *v == View::All) {
            return Ok(None);
        }
        let all = PySlice::full(py).into_any();
        let zero = 0i64.into_pyobject(py)?.into_any();
        let items = view.iter().map(|v| match v {
            View::All => all.clone(),
            View::Drop => zero.clone(),
            View::New => py.None().into_bound(py),
        });
        PyTuple::new(py, items).map(Some)
    }

    /// How many runs there are.
    #[getter]
    fn run_count(&self) -> PyResult<usize> {
        Ok(self.plan()?.plan.runs.len())
    }

    /// Leading dims of the box that pick the run.
    #[getter]
    fn lead(&self) -> PyResult<usize> {
        Ok(self.plan()?.plan.lead)
    }

    /// The reads, `(begin, end)` in bytes from the tensor's start.
    #[getter]
    fn reads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.plan()?.reads)
    }

    /// Each read's strips of runs: `(first run, runs, elements between runs, first run's element
    /// in the read)`.
    #[getter]
    fn strips<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.plan()?.strips)
    }

    /// The reads as a load's byte ranges of tensor `name`: `(name, begin, end)`.
    fn ranges_named<'py>(
        &self,
        py: Python<'py>,
        name: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let reads = self.plan()?.reads.iter();
        PyList::new(py, reads.map(|&(b, e)| (name.clone(), b, e)))
    }

    /// The bytes the reads hold (the gaps they span included).
    #[getter]
    fn read_bytes(&self) -> PyResult<u64> {
        Ok(self.plan()?.reads.iter().map(|(b, e)| e - b).sum())
    }

    #[getter]
    fn read_count(&self) -> PyResult<usize> {
        Ok(self.plan()?.reads.len())
    }

    /// The strips of the read that begins at `begin` (see `strips`).
    fn strips_at<'py>(&self, py: Python<'py>, begin: u64) -> PyResult<Bound<'py, PyList>> {
        let reads = self.plan()?;
        let at = reads.reads.partition_point(|r| r.0 < begin);
        match reads.reads.get(at) {
            Some(r) if r.0 == begin => PyList::new(py, &reads.strips[at]),
            _ => Err(crate::Error::option("begin", format!("no read begins at {begin}")).into()),
        }
    }
}

/// The `parts` a `Stream` reads: `(name, begin, end)` byte ranges within tensors, or `(name,
/// region)`, a planned region's reads (expanded here: no Python int per read).
pub(crate) struct PartRanges(pub Vec<crate::options::Part>);

impl FromPyObject<'_, '_> for PartRanges {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let mut out = Vec::new();
        for item in obj.try_iter()? {
            let item = item?;
            if let Ok((name, region)) = item.extract::<(String, PyRef<'_, Region>)>() {
                let reads = region.plan()?.reads.iter();
                out.extend(reads.map(|&(b, e)| (name.clone(), b, e)));
            } else {
                out.push(item.extract::<crate::options::Part>()?);
            }
        }
        Ok(PartRanges(out))
    }
}

fn merge_settings(m: (u64, bool, f64, f64, u64)) -> Merge {
    let (read_cost, spans, waste, spans_win, span_max) = m;
    Merge {
        read_cost,
        spans,
        waste,
        spans_win,
        span_max,
    }
}

/// `crate::regions::merge` of `runs` (`(offset, len)`, increasing, disjoint) with `merge`'s
/// settings (as `plan_region` takes them): `(first run, runs)` groups read as one.
#[pyfunction]
pub(crate) fn merge_runs(
    runs: Vec<(u64, u64)>,
    merge: (u64, bool, f64, f64, u64),
) -> Vec<(usize, usize)> {
    regions::merge(&runs, &merge_settings(merge))
}

fn refusal(r: Refused) -> (&'static str, usize, Option<usize>) {
    match r {
        Refused::Item(at) => ("item", at, None),
        Refused::Step(at) => ("step", at, None),
        Refused::Ellipses => ("ellipses", 0, None),
        Refused::TooMany { used } => ("too_many", used, None),
        Refused::OutOfRange { at, dim } => ("out_of_range", at, Some(dim)),
    }
}

/// `tensor[index]` of a C-contiguous tensor of `shape` with elements of `itemsize` bytes, as a
/// [`Region`]: its runs planned with `read_cost` per request (`crate::regions::plan`), grouped
/// into reads by `merge` (`(read_cost, spans, waste, spans_win, span_max)`, see
/// `crate::regions::Merge`; `None`: a read per run). `new_axes`: `None` in the index is a dim
/// added (else refused). Planned once per distinct region in the process.
#[pyfunction]
#[pyo3(signature = (shape, itemsize, index, read_cost, merge=None, new_axes=true))]
pub(crate) fn plan_region(
    shape: Vec<u64>,
    itemsize: u64,
    index: &Bound<'_, PyAny>,
    read_cost: u64,
    merge: Option<(u64, bool, f64, f64, u64)>,
    new_axes: bool,
) -> PyResult<Region> {
    let items = items(index)?;
    let dims: Vec<Dim> = match regions::normalize(&items, &shape, new_axes) {
        Ok(dims) => dims,
        Err(r) => {
            return Ok(Region {
                refused: Some(refusal(r)),
                shape: Vec::new(),
                reads: None,
            })
        }
    };
    let merge = merge.map(merge_settings);
    let reads = regions::planner().reads(&dims, &shape, itemsize, read_cost, merge.as_ref());
    Ok(Region {
        refused: None,
        shape: regions::shape_of(&dims),
        reads,
    })
}
