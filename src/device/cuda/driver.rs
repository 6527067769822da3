//! libcuda, opened at run time: the few driver entry points the engine calls, resolved once.
//!
//! Not cudarc's loader, for two reasons that reach users:
//! - it tries `libcuda.so` before `libcuda.so.1`; `libcuda.so` is the name a CUDA toolkit's stub
//!   directory provides (its `cuInit` returns `CUDA_ERROR_STUB_LIBRARY`), and such a directory on
//!   `LD_LIBRARY_PATH` would then win over the real driver that torch uses. The driver's own
//!   name is `libcuda.so.1` (its soname), tried first here, as the CUDA runtime does;
//! - a missing symbol is a panic inside whichever driver call first needs it, on whichever
//!   thread; here every symbol is resolved when the library is opened, and a missing one is an
//!   error of the probe.

#![allow(unsafe_code, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// A `CUresult`: 0 is success. Kept as an integer (a Rust enum would make an unknown code UB).
pub type Status = c_int;
pub type Device = c_int;
pub type Context = *mut c_void;
pub type Stream = *mut c_void;
pub type Event = *mut c_void;
pub type DevicePtr = u64;

pub const CUDA_ERROR_NOT_INITIALIZED: Status = 3;
pub const CUDA_ERROR_NO_DEVICE: Status = 100;
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;
pub const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 0x08;
pub const CU_STREAM_NON_BLOCKING: c_uint = 0x01;
pub const CU_EVENT_BLOCKING_SYNC: c_uint = 0x01;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x02;
pub const CU_EVENT_WAIT_DEFAULT: c_uint = 0x00;

/// Library names, the driver's soname first.
const NAMES: [&CStr; 2] = [c"libcuda.so.1", c"libcuda.so"];

macro_rules! entry_points {
    ($($field:ident: fn($($arg:ty),*);)*) => {
        /// The opened driver: one function pointer per entry point, named as in `cuda.h`.
        pub struct Api {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> Status,)*
        }

        impl Api {
            /// # Safety
            /// `handle` is an open libcuda whose symbols have the signatures of `cuda.h`.
            unsafe fn resolve(handle: *mut c_void, library: &'static str) -> Result<Api, String> {
                Ok(Api {
                    $($field: {
                        let name = concat!(stringify!($field), "\0");
                        // SAFETY: a NUL-terminated name; `handle` is open and never closed.
                        let sym = unsafe { libc::dlsym(handle, name.as_ptr().cast()) };
                        if sym.is_null() {
                            return Err(format!(
                                "CUDA driver {library} has no {} (the driver is too old or not \
                                 NVIDIA's)",
                                stringify!($field)
                            ));
                        }
                        // SAFETY: the symbol of that name has this signature in the driver API.
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> Status>(sym)
                        }
                    },)*
                })
            }
        }
    };
}

entry_points! {
    cuInit: fn(c_uint);
    cuDriverGetVersion: fn(*mut c_int);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGet: fn(*mut Device, c_int);
    cuDevicePrimaryCtxRetain: fn(*mut Context, Device);
    cuCtxSetCurrent: fn(Context);
    cuCtxGetCurrent: fn(*mut Context);
    cuStreamCreate: fn(*mut Stream, c_uint);
    cuStreamDestroy_v2: fn(Stream);
    cuStreamWaitEvent: fn(Stream, Event, c_uint);
    cuEventCreate: fn(*mut Event, c_uint);
    cuEventRecord: fn(Event, Stream);
    cuEventSynchronize: fn(Event);
    cuEventDestroy_v2: fn(Event);
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
    cuMemFreeHost: fn(*mut c_void);
    cuMemHostRegister_v2: fn(*mut c_void, usize, c_uint);
    cuMemHostUnregister: fn(*mut c_void);
    cuMemAlloc_v2: fn(*mut DevicePtr, usize);
    cuMemFree_v2: fn(DevicePtr);
    cuMemcpyHtoDAsync_v2: fn(DevicePtr, *const c_void, usize, Stream);
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, DevicePtr, usize, Stream);
    cuGetErrorName: fn(Status, *mut *const c_char);
    cuGetErrorString: fn(Status, *mut *const c_char);
}

// SAFETY: function pointers into a library that stays loaded for the life of the process.
unsafe impl Send for Api {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Api {}

/// The driver, opened on first use (never at import); the error says what is missing.
pub fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn open() -> Result<Api, String> {
    for name in NAMES {
        // SAFETY: a NUL-terminated name; the handle is kept open for the life of the process.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            let library = name.to_str().expect("ASCII names");
            // SAFETY: a libcuda by name; the driver API's signatures.
            return unsafe { Api::resolve(handle, library) };
        }
    }
    Err(
        "CUDA driver not found: libcuda.so.1 could not be loaded (is an NVIDIA driver installed, \
         and this a GPU machine?)"
            .into(),
    )
}

impl Api {
    /// "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)" for `status`.
    pub fn describe(&self, status: Status) -> String {
        let text = |f: unsafe extern "C" fn(Status, *mut *const c_char) -> Status| {
            let mut s: *const c_char = std::ptr::null();
            // SAFETY: the driver writes a pointer to a static string, or fails.
            if unsafe { f(status, &mut s) } != 0 || s.is_null() {
                return None;
            }
            // SAFETY: NUL-terminated, static in the driver.
            Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
        };
        let name = text(self.cuGetErrorName).unwrap_or_else(|| format!("CUresult {status}"));
        match text(self.cuGetErrorString) {
            Some(t) => format!("{name} ({t})"),
            None => name,
        }
    }
}
