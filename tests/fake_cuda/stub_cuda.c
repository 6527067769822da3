/*
 * A stand-in for the CUDA toolkit's stub libcuda.so (cuda/lib64/stubs/libcuda.so): the library
 * that programs link against at build time. It exports the driver's entry points, but every one
 * returns CUDA_ERROR_STUB_LIBRARY (34), since the real driver is not there. A process that finds
 * this library first (e.g. a toolkit's stubs directory on LD_LIBRARY_PATH) cannot use the GPU
 * through it. Only `libcuda.so` exists, no `libcuda.so.1`, as in the toolkit.
 *
 * Built by tests/cuda_sim.py (build_stub).
 */
#include <stddef.h>

typedef int CUresult;
enum { STUB_LIBRARY = 34 };

CUresult cuInit(unsigned flags) { (void)flags; return STUB_LIBRARY; }
CUresult cuDriverGetVersion(int *v) { (void)v; return STUB_LIBRARY; }
CUresult cuDeviceGetCount(int *n) { (void)n; return STUB_LIBRARY; }
CUresult cuDeviceGet(int *d, int ordinal) { (void)d; (void)ordinal; return STUB_LIBRARY; }

CUresult cuGetErrorName(CUresult r, const char **s) {
    if (r != STUB_LIBRARY) return STUB_LIBRARY;
    *s = "CUDA_ERROR_STUB_LIBRARY";
    return 0;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    if (r != STUB_LIBRARY) return STUB_LIBRARY;
    *s = "CUDA driver is a stub library";
    return 0;
}
