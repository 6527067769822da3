//! DLPack export: a capsule whose tensor views Rust-owned memory: host buffers (kDLCPU) or device
//! memory the driver allocated (kDLCUDA). The managed tensor keeps the memory's owner (an `Arc`
//! of the buffer or allocation); the deleter (called by the consumer when the tensor dies, or by
//! the capsule destructor if nobody consumed it) only drops that owner.

#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::format::Dtype;
use crate::memory::HostBuffer;

const CAPSULE_NAME: &CStr = c"dltensor";
const K_DL_CPU: i32 = 1;
const K_DL_CUDA: i32 = 2;

/// Where a capsule's memory is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    device_type: i32,
    device_id: i32,
}

impl DLDevice {
    pub const CPU: DLDevice = DLDevice {
        device_type: K_DL_CPU,
        device_id: 0,
    };

    /// The device of a staged load's destinations, from its engine's name ("host", "cuda:N").
    pub fn of_engine(name: &str) -> DLDevice {
        match crate::device::parse_cuda(name) {
            Ok(n) => DLDevice {
                device_type: K_DL_CUDA,
                device_id: n as i32,
            },
            Err(_) => DLDevice::CPU,
        }
    }
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

struct Context {
    _owner: Box<dyn Any + Send>,
    shape: Vec<i64>,
    strides: Vec<i64>,
    managed: DLManagedTensor,
}

/// DLPack (code, bits) for dtypes torch takes natively; others travel as bytes (uint8) and are
/// viewed in Python.
pub fn native(dtype: Dtype) -> Option<(u8, u8)> {
    const INT: u8 = 0;
    const UINT: u8 = 1;
    const FLOAT: u8 = 2;
    const BFLOAT: u8 = 4;
    const COMPLEX: u8 = 5;
    const BOOL: u8 = 6;
    Some(match dtype {
        Dtype::Bool => (BOOL, 8),
        Dtype::U8 => (UINT, 8),
        Dtype::I8 => (INT, 8),
        Dtype::I16 => (INT, 16),
        Dtype::I32 => (INT, 32),
        Dtype::I64 => (INT, 64),
        Dtype::F16 => (FLOAT, 16),
        Dtype::F32 => (FLOAT, 32),
        Dtype::F64 => (FLOAT, 64),
        Dtype::BF16 => (BFLOAT, 16),
        Dtype::C64 => (COMPLEX, 64),
        _ => return None,
    })
}

unsafe extern "C" fn deleter(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: manager_ctx was made by Box::into_raw in `capsule` and is freed exactly once here.
    let ctx = unsafe { (*managed).manager_ctx } as *mut Context;
    drop(unsafe { Box::from_raw(ctx) });
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumed capsule is renamed "used_dltensor" and then belongs to the consumer.
    // SAFETY: capsule is a live capsule object passed by the interpreter.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*managed).deleter {
                d(managed);
            }
        }
    }
}

/// A `dltensor` capsule viewing `len` bytes at `offset` of `buffer` as `shape` of `dtype` (or as
/// a flat uint8 array when `dtype` has no native DLPack code).
pub fn capsule(
    py: Python<'_>,
    buffer: &Arc<HostBuffer>,
    offset: u64,
    len: u64,
    dtype: Dtype,
    shape: &[u64],
) -> PyResult<Py<PyAny>> {
    assert!(
        offset + len <= buffer.len() as u64,
        "tensor outside its buffer"
    );
    // SAFETY: offset + len is inside the buffer (asserted above).
    let data = unsafe { buffer.as_ptr().add(offset as usize) } as u64;
    let owner = Box::new(buffer.clone());
    // SAFETY: `data .. data + len` lies in the buffer, which `owner` keeps alive.
    unsafe { capsule_of(py, data, DLDevice::CPU, owner, len, dtype, shape) }
}

/// A `dltensor` capsule viewing `len` bytes at address `data` on `device`, kept alive by `owner`
/// (dropped by the deleter, on whichever thread the consumer frees the tensor).
///
/// # Safety
/// `data .. data + len` must be memory of `device` that stays valid while `owner` lives.
pub unsafe fn capsule_of(
    py: Python<'_>,
    data: u64,
    device: DLDevice,
    owner: Box<dyn Any + Send>,
    len: u64,
    dtype: Dtype,
    shape: &[u64],
) -> PyResult<Py<PyAny>> {
    let (code, bits, shape): (u8, u8, Vec<i64>) = match native(dtype) {
        Some((c, b)) => (c, b, shape.iter().map(|&d| d as i64).collect()),
        None => (1, 8, vec![len as i64]),
    };
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    let mut ctx = Box::new(Context {
        _owner: owner,
        shape,
        strides,
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data as *mut c_void,
                device,
                ndim: 0,
                dtype: DLDataType {
                    code,
                    bits,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(deleter),
        },
    });
    ctx.managed.dl_tensor.ndim = ctx.shape.len() as i32;
    ctx.managed.dl_tensor.shape = ctx.shape.as_mut_ptr();
    ctx.managed.dl_tensor.strides = ctx.strides.as_mut_ptr();
    let raw = Box::into_raw(ctx);
    // SAFETY: raw is a valid, uniquely owned Context; the managed tensor lives inside it, so its
    // address is stable until the deleter frees the box.
    unsafe {
        (*raw).managed.manager_ctx = raw as *mut c_void;
        let managed = &mut (*raw).managed as *mut DLManagedTensor;
        let cap = ffi::PyCapsule_New(
            managed as *mut c_void,
            CAPSULE_NAME.as_ptr(),
            Some(capsule_destructor),
        );
        if cap.is_null() {
            deleter(managed);
            return Err(PyErr::fetch(py));
        }
        Ok(Py::from_owned_ptr(py, cap))
    }
}
