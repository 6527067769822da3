//! fastload: safetensors from local disks and object stores into host (and device) memory, with
//! many reads in flight, bounded host memory, and tensors handed out as soon as they land.
//!
//! Data flows one way: [`format`] (header bytes → validated entries) → [`source`] (every byte
//! source behind one [`source::Source`] trait: local files, object stores, the Hugging Face Hub,
//! and the local cache in front of them; [`source::open`] decides what a URI names) →
//! [`plan`] (shards + options → segments) → [`memory`] / [`device`] (where bytes land) →
//! [`pipeline`] (reads every block through `Source`, hands tensors out) → the Python bindings and
//! the [`cli`]. [`options`], [`error`], [`bounded`] (reads of whole files and bodies, capped),
//! [`runtime`] and [`per_process`] (state a forked child rebuilds)
//! serve every stage.

#![deny(unsafe_code)]

pub mod bounded;
pub mod cli;
pub mod device;
pub mod error;
pub mod format;
pub mod memory;
pub mod options;
pub mod per_process;
pub mod pipeline;
pub mod plan;
pub mod ranges;
pub mod ranks;
pub mod runtime;
pub mod source;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use options::{LoadOptions, Method, Size};
pub use pipeline::{open, open_staged, Control, Loaded, Loader, Memory, Stats};

/// The crate version (also the Python package's `__version__`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
