//! The distributed loader's questions to the planner in `crate::ranks`: the checkpoint's tensors
//! (read from the headers, checked as a local load checks them) and the plan of the exchange.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::args::{Names, PeerTokenArg, PeersArg, StorageOptions};
use crate::ranks::{self, Entry};

/// Every tensor of the files `uris` name, in file order, as `(name, dtype, shape, bytes)`; reads
/// headers only. Raises what a local load raises for the same files: `FormatError` for a name in
/// two files, `TensorNotFoundError` for a name in `names` that no file holds.
#[pyfunction]
#[pyo3(signature = (uris, *, names=None, storage_options=None, keyset=None, associated_data=None, peers=None, peer_token=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn checkpoint_tensors<'py>(
    py: Python<'py>,
    uris: Vec<String>,
    names: Option<Names>,
    storage_options: Option<StorageOptions>,
    keyset: Option<super::tink::KeysetArg>,
    associated_data: Option<super::tink::AssociatedDataArg>,
    peers: Option<PeersArg>,
    peer_token: Option<PeerTokenArg>,
) -> PyResult<Bound<'py, PyList>> {
    let decryption = super::tink::decryption(keyset, associated_data)?;
    let storage_options = storage_options.unwrap_or_default().0;
    let names = names.map(|n| n.0);
    // The headers come from the load's peers (`peers`, else FASTLOAD_PEERS), as its bytes do.
    let mut settings = crate::source::cache::CacheSettings::off();
    settings.peers =
        crate::source::peer::PeerSettings::resolve(peers.map(|p| p.0), peer_token.map(|t| t.0))?;
    let entries = super::gil::detach(py, || {
        let shards =
            crate::source::open::open_all(&uris, &storage_options, &settings, &decryption)?;
        ranks::entries(shards, names.as_deref())
    })?;
    let out = PyList::empty(py);
    for t in &entries {
        out.append((
            t.name.as_str(),
            t.dtype.as_str(),
            PyTuple::new(py, &t.shape)?,
            t.len(),
        ))?;
    }
    Ok(out)
}

/// The plan of a distributed load, the same on every rank (see `crate::ranks`). Pieces are
/// `(tensor, begin, end)`: bytes of wanted tensor `tensors[tensor]`.
#[pyclass(module = "fastload._fastload", frozen)]
pub struct RankPlan {
    /// The rows of the table that some rank wants, in file order.
    #[pyo3(get)]
    tensors: Py<PyTuple>,
    /// Their bytes, end to end.
    #[pyo3(get)]
    total: u64,
    /// Per rank: `(begin, end)` of that total.
    #[pyo3(get)]
    ranges: Py<PyTuple>,
    #[pyo3(get)]
    rounds: usize,
    /// `pieces[rank][round]`: the pieces that rank reads for that round.
    #[pyo3(get)]
    pieces: Py<PyTuple>,
    /// Per wanted tensor: how many pieces it is cut into.
    #[pyo3(get)]
    counts: Py<PyTuple>,
    /// Bytes each rank moves per round at most.
    #[pyo3(get)]
    chunk: u64,
    plan: ranks::RankPlan,
    table: Vec<Entry>,
}

#[pymethods]
impl RankPlan {
    /// Whether `rank` wants wanted tensor `tensor`.
    fn wants(&self, rank: usize, tensor: usize) -> bool {
        self.plan.wants(rank, tensor)
    }

    /// What `rank` reads from storage: `(name, begin, end)` byte ranges for `Stream(parts=...)`.
    fn parts(&self, rank: usize) -> Vec<crate::plan::Part> {
        self.plan.parts(rank, &self.table)
    }
}

/// Plans a load of `tensors` (rows as `checkpoint_tensors` returns them) over ranks that want
/// `needs` (per rank: names, or `None` for every tensor), each round moving what the smallest of
/// the ranks' `memory_limits` allows.
#[pyfunction]
pub(crate) fn plan_ranks(
    py: Python<'_>,
    tensors: Vec<Bound<'_, PyTuple>>,
    needs: Vec<Option<Vec<String>>>,
    memory_limits: Vec<u64>,
) -> PyResult<RankPlan> {
    let table = tensors
        .iter()
        .map(|row| {
            Ok(Entry {
                name: row.get_item(0)?.extract()?,
                len: row.get_item(3)?.extract()?,
            })
        })
        .collect::<PyResult<Vec<Entry>>>()?;
    let needs: Vec<Option<HashSet<String>>> = needs
        .into_iter()
        .map(|n| n.map(|n| n.into_iter().collect()))
        .collect();
    let chunk = memory_limits
        .iter()
        .map(|&m| ranks::chunk_for(m))
        .min()
        .unwrap_or(ranks::MAX_CHUNK);
    let plan = super::gil::detach(py, || ranks::RankPlan::new(&table, &needs, chunk));
    let piece = |p: &ranks::Piece| (p.tensor, p.begin, p.end);
    let pieces = plan
        .pieces
        .iter()
        .map(|rounds| {
            let rounds = rounds
                .iter()
                .map(|ps| PyTuple::new(py, ps.iter().map(piece)))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, rounds)
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(RankPlan {
        tensors: PyTuple::new(py, plan.tensors.iter().map(|&i| &tensors[i]))?.unbind(),
        total: plan.total,
        ranges: PyTuple::new(py, &plan.ranges)?.unbind(),
        rounds: plan.rounds,
        pieces: PyTuple::new(py, pieces)?.unbind(),
        counts: PyTuple::new(py, &plan.counts)?.unbind(),
        chunk,
        plan,
        table,
    })
}
