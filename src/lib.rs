//! fastload: safetensors from local disks, object stores and the Hugging Face Hub into host (and
//! device) memory, with many reads in flight, bounded host memory, and tensors handed out as soon
//! as they land.
//!
//! The modules, lowest layer first; a module imports only from its own layer and the ones below
//! (`scripts/check_modules.py` checks it, that this list is its own, and fails on a cycle):
//!
//! - [`format`](mod@format): the checkpoint format: safetensors header bytes → validated entries, and the
//!   shard names of an index file (`model.safetensors.index.json`). Imports nothing of the crate.
//! - shared leaves, serving every stage above the format: `arguments` (how each front end names
//!   an argument: keyword, flag, variable), `error` (the one error type, [`Error`]), [`options`]
//!   (what a load asks for, `FASTLOAD_*`), `bounded` (files and bodies
//!   read whole, capped), [`runtime`] (the process's tokio runtime) and `per_process` (state a
//!   forked child rebuilds); and the two leaves both directions (reading and writing) share:
//!   [`uri`] (the one table of schemes, the only place that decides what a URI names) and
//!   [`tink`] (Tink's streaming-AEAD cipher: keysets and the wire format).
//! - `memory`: host buffers (the pool, mappings) that bytes land in.
//! - `store`: the object-store clients both directions build (a URI and storage options to a
//!   store of s3://, gs://, az://, http(s)://; credentials, signing, errors, shared HTTP clients,
//!   retry settings).
//! - [`source`]: every byte source behind one [`source::Source`] trait, and the opening of URIs
//!   into sources with their headers ([`source::Shard`]): `source::open` (each URI opened as
//!   the scheme table says), `source::decrypt` (the decrypting decorator), `source::local` (files, shard
//!   folders), `source::fs` (what filesystem a file is on), [`source::object`] (s3://, gs://,
//!   az://, http(s)://), `source::hub` (hf://: the Hub's API client, the Hugging Face cache's
//!   layout, the files), `source::remote` (the one resumable ranged read both remote kinds go
//!   through), `source::cache` (the local cache, a decorator only `open` applies) and
//!   `source::identity` (who a remote object is: the data the cache and the Hub share). Beside
//!   it, never importing it nor imported by it, [`sink`]: the write direction, every destination
//!   behind one [`sink::Sink`] trait (a local file, one PUT, a multipart upload, an encrypting
//!   decorator), each published whole or not at all (a rename, an upload completed last), and
//!   safetensors files written through them.
//! - [`copy`]: `fastload copy`: files read from sources and written to sinks, resumably, split
//!   across the ranks of a group.
//! - [`plan`] (shards + options → segments and blocks), [`regions`] (a tensor's region: its
//!   index normalised, the runs and reads it needs, by the source's cost of a request), `ranges`
//!   (chosen byte ranges of one source, for slices) and `ranks` (the plan shared by the ranks of
//!   a process group).
//! - [`device`]: where tensors go when they leave host memory (the CUDA copy engine).
//! - [`pipeline`]: runs a plan: reads every block through `Source`, bounded in bytes and reads
//!   in flight, and hands tensors out as their segments land.
//! - [`serve`]: `fastload serve`: checkpoints of any source served to peers over HTTP ranges.
//! - the Python bindings (`python`, with the `python` feature) and the command line, [`cli`].
//!
//! Public here is what the binary, the integration tests, the benches and the fuzz targets use;
//! the rest is `pub(crate)`.

#![deny(unsafe_code)]

pub(crate) mod arguments;
pub(crate) mod bounded;
pub mod cli;
pub mod device;
pub(crate) mod error;
pub mod format;
pub(crate) mod memory;
pub mod options;
pub(crate) mod per_process;
pub mod pipeline;
pub mod plan;
// `ranges` and `ranks` serve the bindings only; their unit tests run in every build.
pub mod copy;
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) mod ranges;
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) mod ranks;
pub mod regions;
pub mod runtime;
pub mod serve;
pub mod sink;
pub mod source;
pub mod store;
pub mod tink;
pub mod uri;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use options::{LoadOptions, Method, Size};
pub use pipeline::{open, open_staged, Control, Loaded, Loader, Memory, Stats};

/// The crate version (also the Python package's `__version__`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
