//! Python inputs of the load options, each converted once, at the edge, into an owned Rust value.
//! A value of the wrong shape raises `fastload.ConfigError` (a `ValueError`) whose `option` names
//! the argument, as a value out of range does; nothing downstream sees a Python object.

use std::collections::HashSet;
use std::marker::PhantomData;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyMapping, PyString};

use crate::options::{CacheChoice, Method, Size};
use crate::Error;

/// Names an option in the errors of its conversion.
pub trait OptionName {
    const NAME: &'static str;
}

/// `block_size`.
pub enum BlockSize {}
/// `memory_limit`.
pub enum MemoryLimit {}

impl OptionName for BlockSize {
    const NAME: &'static str = "block_size";
}
impl OptionName for MemoryLimit {
    const NAME: &'static str = "memory_limit";
}
/// `part_size` (of a write's upload parts).
pub enum PartSize {}
impl OptionName for PartSize {
    const NAME: &'static str = "part_size";
}
/// `overwrite`.
pub enum Overwrite {}
impl OptionName for Overwrite {
    const NAME: &'static str = "overwrite";
}

fn type_name(obj: &Borrowed<'_, '_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// A byte count.
///
/// Supported Python input: an `int` >= 0, or a `str` such as `"64MiB"`, `"1.5GB"`, `"4096"`
/// (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; see [`Size`]). Not `bool`.
pub struct Bytes<N>(pub u64, PhantomData<N>);

impl<N: OptionName> FromPyObject<'_, '_> for Bytes<N> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let bytes = if obj.is_instance_of::<PyBool>() {
            Err(format!(
                "expected an int or a string like \"64MiB\", got {}",
                type_name(&obj)
            ))
        } else if let Ok(n) = obj.extract::<i128>() {
            u64::try_from(n).map_err(|_| format!("{n} is not a byte count"))
        } else if let Ok(s) = obj.cast::<PyString>() {
            s.to_cow()?.parse::<Size>().map(|s| s.0)
        } else {
            Err(format!(
                "expected an int or a string like \"64MiB\", got {}",
                type_name(&obj)
            ))
        };
        match bytes {
            Ok(b) => Ok(Bytes(b, PhantomData)),
            Err(message) => Err(Error::option(N::NAME, message).into()),
        }
    }
}

/// Reads in flight.
///
/// Supported Python input: an `int` >= 1 (the upper bound is checked when options are resolved).
/// Not `bool`, not a numeric `str`.
pub struct Concurrency(pub usize);

impl FromPyObject<'_, '_> for Concurrency {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        positive_int(obj, "concurrency").map(Concurrency)
    }
}

/// Copy queues of a GPU load (`copy_streams`).
///
/// Supported Python input: an `int` >= 1 (the upper bound is checked when options are resolved).
/// Not `bool`, not a numeric `str`.
pub struct CopyStreams(pub usize);

impl FromPyObject<'_, '_> for CopyStreams {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        positive_int(obj, "copy_streams").map(CopyStreams)
    }
}

/// An `int` >= 1 given as `option` (not a `bool`, not a numeric `str`).
fn positive_int(obj: Borrowed<'_, '_, PyAny>, option: &str) -> PyResult<usize> {
    let n = if obj.is_instance_of::<PyBool>() {
        None
    } else {
        obj.extract::<i128>().ok()
    };
    match n {
        Some(n) if n >= 1 => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => Err(Error::option(option, format!("{n} is not a positive int")).into()),
        None => Err(Error::option(
            option,
            format!("expected a positive int, got {}", type_name(&obj)),
        )
        .into()),
    }
}

/// How local files are read.
///
/// Supported Python input: `"auto"`, `"mmap"`, `"read"` (or `"pread"`), `"direct"`, in any case.
pub struct MethodArg(pub Method);

impl FromPyObject<'_, '_> for MethodArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let method = match obj.cast::<PyString>() {
            Ok(s) => s.to_cow()?.parse::<Method>(),
            Err(_) => Err(format!(
                "expected \"auto\", \"mmap\" or \"read\", got {}",
                type_name(&obj)
            )),
        };
        method
            .map(MethodArg)
            .map_err(|e| Error::option("method", e).into())
    }
}

/// The local cache of remote objects.
///
/// Supported Python input: `True` (the default directory), `False` (off), a `str` or
/// `os.PathLike` (that directory).
pub struct CacheArg(pub CacheChoice);

impl FromPyObject<'_, '_> for CacheArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<PyBool>() {
            return Ok(CacheArg(match b.is_true() {
                true => CacheChoice::Default,
                false => CacheChoice::Off,
            }));
        }
        let path = obj
            .py()
            .import("os")?
            .getattr("fspath")?
            .call1((obj.to_owned(),))
            .ok()
            .and_then(|p| p.extract::<String>().ok());
        match path {
            Some(p) if !p.is_empty() => Ok(CacheArg(CacheChoice::Dir(p.into()))),
            _ => Err(Error::option(
                "cache",
                format!(
                    "expected True, False or a directory (str or os.PathLike), got {}",
                    type_name(&obj)
                ),
            )
            .into()),
        }
    }
}

/// Whether sha256s are checked (`verify=`).
///
/// Supported Python input: `True` or `False`.
pub struct VerifyArg(pub bool);

impl FromPyObject<'_, '_> for VerifyArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        match obj.cast::<PyBool>() {
            Ok(b) => Ok(VerifyArg(b.is_true())),
            Err(_) => Err(Error::option(
                "verify",
                format!("expected True or False, got {}", type_name(&obj)),
            )
            .into()),
        }
    }
}

/// A yes/no argument (`overwrite=`).
///
/// Supported Python input: `True` or `False` (not `0`, `1` or `"yes"`: a typo must not pass).
pub struct Switch<N>(pub bool, PhantomData<N>);

impl<N> Switch<N> {
    /// `False`, the default of a signature.
    pub const fn off() -> Self {
        Switch(false, PhantomData)
    }
}

impl<N: OptionName> FromPyObject<'_, '_> for Switch<N> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        match obj.cast::<PyBool>() {
            Ok(b) => Ok(Switch(b.is_true(), PhantomData)),
            Err(_) => Err(Error::option(
                N::NAME,
                format!("expected a bool, got {}", type_name(&obj)),
            )
            .into()),
        }
    }
}

/// Object-store settings (`endpoint`, `region`, `access_key_id`, ...).
///
/// Supported Python input: a `dict` (or any `collections.abc.Mapping`) with `str` keys; values
/// are converted with `str()` (so numbers work), `bool` as `"true"`/`"false"`.
#[derive(Default)]
pub struct StorageOptions(pub Vec<(String, String)>);

impl FromPyObject<'_, '_> for StorageOptions {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let bad = |message: &str| -> PyErr { Error::option("storage_options", message).into() };
        let dict = match obj.cast::<PyDict>() {
            Ok(d) => d.to_owned(),
            Err(_) => {
                let mapping = obj.py().import("collections.abc")?.getattr("Mapping")?;
                if !obj.is_instance(&mapping)? {
                    return Err(bad(&format!(
                        "expected a dict with str keys, got {}",
                        type_name(&obj)
                    )));
                }
                let d = PyDict::new(obj.py());
                let mapping = obj.cast::<PyMapping>().map_err(PyErr::from)?;
                d.update(&mapping)?;
                d
            }
        };
        let mut out = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            let key: String = k.extract().map_err(|_| bad("keys must be strings"))?;
            let value = match v.cast::<PyBool>() {
                Ok(b) => b.is_true().to_string(),
                Err(_) => v.str()?.to_string(),
            };
            out.push((key, value));
        }
        Ok(StorageOptions(out))
    }
}

/// Tensor names to load.
///
/// Supported Python input: any iterable of `str` (list, tuple, set, generator, dict keys),
/// consumed once; duplicates are dropped, the first occurrence's order kept. A bare `str` is one
/// name (`names="lm_head.weight"`): tensor names are never meant as their characters.
pub struct Names(pub Vec<String>);

impl FromPyObject<'_, '_> for Names {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let bad = |what: String| -> PyErr { Error::option("names", what).into() };
        if let Ok(one) = obj.cast::<PyString>() {
            return Ok(Names(vec![one.to_cow()?.into_owned()]));
        }
        let iter = obj.try_iter().map_err(|_| {
            bad(format!(
                "expected an iterable of str, got {}",
                type_name(&obj)
            ))
        })?;
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for item in iter {
            let item = item?;
            let name: String = item.extract().map_err(|_| {
                bad(format!(
                    "expected an iterable of str, got an item of type {}",
                    item.get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })?;
            if seen.insert(name.clone()) {
                out.push(name);
            }
        }
        Ok(Names(out))
    }
}

/// The serves a load reads from first (`peers=`).
///
/// Supported Python input: a `str` (one peer, or several comma-separated as `FASTLOAD_PEERS`
/// takes them) or an iterable of `str` (`"host:port"`, `"https://host:port"`).
pub struct PeersArg(pub Vec<String>);

impl FromPyObject<'_, '_> for PeersArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            let s = s.to_cow()?;
            return Ok(PeersArg(s.split(',').map(str::to_string).collect()));
        }
        let wrong = || {
            PyErr::from(Error::option(
                "peers",
                format!(
                    "expected a list of \"host:port\" strings, got {}",
                    type_name(&obj)
                ),
            ))
        };
        let items = obj.try_iter().map_err(|_| wrong())?;
        let mut peers = Vec::new();
        for item in items {
            let item = item?;
            let s = item.cast::<PyString>().map_err(|_| wrong())?;
            peers.push(s.to_cow()?.into_owned());
        }
        Ok(PeersArg(peers))
    }
}

/// The peers' bearer token (`peer_token=`), kept as a secret.
///
/// Supported Python input: a `str`.
pub struct PeerTokenArg(pub crate::options::Secret);

impl FromPyObject<'_, '_> for PeerTokenArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        match obj.cast::<PyString>() {
            Ok(s) => Ok(PeerTokenArg(crate::options::Secret(
                s.to_cow()?.into_owned().into(),
            ))),
            Err(_) => Err(Error::option(
                "peer_token",
                format!("expected a str, got {}", type_name(&obj)),
            )
            .into()),
        }
    }
}

/// Sets the peers options of `opts` from their Python arguments.
pub fn set_peers(
    opts: &mut crate::options::LoadOptions,
    peers: Option<PeersArg>,
    peer_token: Option<PeerTokenArg>,
) {
    opts.peers = peers.map(|p| p.0);
    opts.peer_token = peer_token.map(|t| t.0);
}
