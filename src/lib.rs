//! fastload: safetensors from local disks and object stores into host (and device) memory, with
//! many reads in flight, bounded host memory, and tensors handed out as soon as they land.
//!
//! Data flows one way: [`format`] → [`plan`] → [`source`] → [`memory`] / [`device`] →
//! [`pipeline`] → the Python bindings and the [`cli`].

#![deny(unsafe_code)]

pub mod cli;
pub mod device;
pub mod error;
pub mod format;
pub mod memory;
pub mod object;
pub mod options;
pub mod pipeline;
pub mod plan;
pub mod ranks;
pub mod runtime;
pub mod source;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use options::{LoadOptions, Method, Size};
pub use pipeline::{open, open_staged, Loaded, Loader, Memory, Stats};

/// The crate version (also the Python package's `__version__`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
