//! The Python inputs of encrypted loads (`keyset=`, `associated_data=`), and, in a build with
//! the `bench-bindings` feature only, `_tink_decrypt` (the bench's AES-GCM rate).

use pyo3::prelude::*;
use pyo3::types::PyString;
use zeroize::Zeroizing;

use crate::options::Secret;
use crate::Error;

fn type_name(obj: &Borrowed<'_, '_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// A Tink keyset (`keyset=`).
///
/// Supported Python input: a `str` holding the cleartext JSON keyset, or the path of a file
/// holding it (`str` or `os.PathLike`). The value is remembered as a secret: no message shows it.
pub struct KeysetArg(pub Secret);

impl FromPyObject<'_, '_> for KeysetArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let text = match obj.cast::<PyString>() {
            Ok(s) => Some(s.to_cow()?.into_owned()),
            Err(_) => obj
                .py()
                .import("os")?
                .getattr("fspath")?
                .call1((obj.to_owned(),))
                .ok()
                .and_then(|p| p.extract::<String>().ok()),
        };
        match text {
            Some(t) if !t.trim().is_empty() => {
                // Whatever it looks like (a path, the JSON, or its base64 by mistake): a
                // secret from here on, before anything parses it.
                let t = Zeroizing::new(t);
                crate::error::remember_secret(&t);
                Ok(KeysetArg(Secret(t)))
            }
            _ => Err(Error::option(
                "keyset",
                format!(
                    "expected a JSON keyset (str) or the path of one (str or os.PathLike), got {}",
                    type_name(&obj)
                ),
            )
            .into()),
        }
    }
}

/// The associated data of an encrypted file (`associated_data=`).
///
/// Supported Python input: `bytes` (or `bytearray`), or a `str` (its UTF-8 bytes).
pub struct AssociatedDataArg(pub Secret<Vec<u8>>);

impl FromPyObject<'_, '_> for AssociatedDataArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(AssociatedDataArg(Secret(Zeroizing::new(
                s.to_cow()?.as_bytes().to_vec(),
            ))));
        }
        match obj.extract::<Vec<u8>>() {
            Ok(b) if !obj.is_instance_of::<pyo3::types::PyList>() => {
                Ok(AssociatedDataArg(Secret(Zeroizing::new(b))))
            }
            _ => Err(Error::option(
                "associated_data",
                format!("expected bytes or str, got {}", type_name(&obj)),
            )
            .into()),
        }
    }
}

/// The decryption of a call that takes only `keyset` and `associated_data` of the options
/// (`inspect`, `checkpoint_tensors`): theirs, else `FASTLOAD_KEYSET`.
pub(crate) fn decryption(
    keyset: Option<KeysetArg>,
    associated_data: Option<AssociatedDataArg>,
) -> crate::Result<crate::source::decrypt::Decryption> {
    crate::source::decrypt::Decryption::for_load(&crate::options::LoadOptions {
        keyset: keyset.map(|k| k.0),
        associated_data: associated_data.map(|a| a.0),
        ..Default::default()
    })
}

/// `ciphertext` (a whole stream) decrypted with the primary key of `keyset`, on the calling
/// thread. `discard`: each segment is decrypted into one reused buffer and nothing is returned,
/// which `benches/encryption_bench.py` times as the CPU's AES-GCM rate (filling a fresh buffer
/// of the whole size would time page faults instead). Not in the shipped module: only a build
/// with the `bench-bindings` feature has it.
#[cfg(feature = "bench-bindings")]
#[pyfunction]
#[pyo3(signature = (keyset, ciphertext, associated_data=None, discard=false))]
pub(crate) fn _tink_decrypt<'py>(
    py: Python<'py>,
    keyset: KeysetArg,
    ciphertext: &[u8],
    associated_data: Option<AssociatedDataArg>,
    discard: bool,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use crate::tink::{segment, Keyset};
    use pyo3::types::PyBytes;

    let keys = Keyset::from_spec(&keyset.0 .0).map_err(|e| Error::option("keyset", e))?;
    let ad = associated_data.map(|a| a.0 .0.to_vec()).unwrap_or_default();
    let failed = |e| crate::source::decrypt::source::error("<bytes>", None, e);
    if discard {
        py.detach(|| segment::decrypt_each(&keys.keys[0], &ad, ciphertext, |_| ()))
            .map_err(failed)?;
        return Ok(PyBytes::new(py, b""));
    }
    let out = py
        .detach(|| segment::decrypt(&keys.keys[0], &ad, ciphertext))
        .map_err(failed)?;
    Ok(PyBytes::new(py, &out))
}
