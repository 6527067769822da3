/*
 * A stand-in for libcuda.so with the few driver entry points fastload calls, so that the CUDA
 * engine (src/device/cuda.rs: cudarc's dynamic loading, the probe, contexts, page-locked staging,
 * async copies, events) runs on machines without a GPU. "Device memory" is host memory.
 *
 * It is stricter than the real driver where that finds our bugs:
 * - copies are queued per stream and only carried out when an event recorded after them is
 *   synchronised (or the stream is), so handing a tensor out before its fence passed, or reusing
 *   a staging buffer too early, yields wrong bytes in the parity tests;
 * - every call that needs a context fails with CUDA_ERROR_INVALID_CONTEXT unless one is current
 *   on the calling thread;
 * - an async copy's source must be page-locked memory from cuMemHostAlloc.
 * Counters go to $FAKE_CUDA_LOG at exit: copies, bytes, peak page-locked bytes.
 * $FAKE_CUDA_DEVICES sets the device count (default 1).
 *
 * Built by tests/test_gpu.py with `cc -shared -fPIC`.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct ctx_s *CUcontext;
typedef struct stream_s *CUstream;
typedef struct event_s *CUevent;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    UNKNOWN = 999,
};

struct ctx_s { int device; };
struct op { void *dst; const void *src; size_t len; };
struct stream_s { struct op *ops; size_t n, cap, done; };
struct event_s { CUstream stream; size_t mark; };
struct region { uintptr_t at; size_t len; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialised;
static struct ctx_s contexts[16];
static __thread CUcontext current;
static struct region pinned[4096];
static size_t pinned_bytes, pinned_peak;
static unsigned long long copies, copied_bytes, host_allocs, host_frees, violations;
static size_t device_now[16], device_peak;

static int physical(void) {
    const char *n = getenv("FAKE_CUDA_DEVICES");
    int d = n ? atoi(n) : 1;
    return d < 0 ? 0 : (d > 16 ? 16 : d);
}

/* Devices visible through CUDA_VISIBLE_DEVICES (a comma list of ordinals; unset: all). */
static int devices(void) {
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (!v) return physical();
    int n = 0;
    for (const char *p = v; *p;) {
        char *end;
        long d = strtol(p, &end, 10);
        if (end == p || d < 0 || d >= physical()) break;
        n++;
        if (*end != ',') break;
        p = end + 1;
    }
    return n;
}

/* FAKE_CUDA_FAIL=name:n[,name:n]: the n-th call of `name` fails with CUDA_ERROR_UNKNOWN. */
static int injected(const char *name) {
    static struct { char name[64]; long at, calls; } rules[16];
    static int parsed, count;
    int hit = 0;
    pthread_mutex_lock(&lock);
    if (!parsed) {
        parsed = 1;
        const char *spec = getenv("FAKE_CUDA_FAIL");
        while (spec && *spec && count < 16) {
            const char *colon = strchr(spec, ':');
            if (!colon || colon - spec >= 64) break;
            memcpy(rules[count].name, spec, colon - spec);
            rules[count].name[colon - spec] = 0;
            rules[count].at = strtol(colon + 1, NULL, 10);
            count++;
            spec = strchr(colon, ',');
            if (spec) spec++;
        }
    }
    for (int i = 0; i < count; i++)
        if (!strcmp(rules[i].name, name) && ++rules[i].calls == rules[i].at) hit = 1;
    pthread_mutex_unlock(&lock);
    return hit;
}
#define INJECT(name) do { if (injected(name)) return UNKNOWN; } while (0)

static void report(void) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (!path) return;
    FILE *f = fopen(path, "w");
    if (!f) return;
    size_t now = 0;
    for (int d = 0; d < 16; d++) now += device_now[d];
    fprintf(f,
            "copies=%llu bytes=%llu pinned_peak=%zu pinned_now=%zu host_allocs=%llu "
            "host_frees=%llu device_peak=%zu device_now=%zu violations=%llu\n",
            copies, copied_bytes, pinned_peak, pinned_bytes, host_allocs, host_frees, device_peak,
            now, violations);
    fclose(f);
}

#define NEED_CONTEXT() do { if (!initialised) return NOT_INITIALIZED; \
                            if (!current) return INVALID_CONTEXT; } while (0)

CUresult cuInit(unsigned flags) {
    (void)flags;
    INJECT("cuInit");
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (v && !*v) return NO_DEVICE;
    pthread_mutex_lock(&lock);
    if (!initialised) atexit(report);
    initialised = 1;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }

CUresult cuDeviceGetCount(int *n) {
    if (!initialised) return NOT_INITIALIZED;
    *n = devices();
    return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (!initialised) return NOT_INITIALIZED;
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    contexts[d].device = d;
    *c = &contexts[d];
    return OK;
}

CUresult cuCtxSetCurrent(CUcontext c) { current = c; return OK; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return OK; }

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    (void)flags;
    NEED_CONTEXT();
    *s = calloc(1, sizeof(struct stream_s));
    return *s ? OK : OUT_OF_MEMORY;
}

/* Carries out the stream's queued copies up to `mark`. Caller holds the lock. */
static void run_until(CUstream s, size_t mark) {
    for (; s->done < mark && s->done < s->n; s->done++) {
        struct op *o = &s->ops[s->done];
        memcpy(o->dst, o->src, o->len);
    }
}

CUresult cuStreamSynchronize(CUstream s) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    if (s) run_until(s, s->n);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuStreamDestroy_v2(CUstream s) {
    NEED_CONTEXT();
    if (!s) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    run_until(s, s->n);
    pthread_mutex_unlock(&lock);
    free(s->ops);
    free(s);
    return OK;
}

CUresult cuMemHostAlloc(void **p, size_t len, unsigned flags) {
    (void)flags;
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    size_t i;
    for (i = 0; i < 4096 && pinned[i].at; i++) {}
    if (i == 4096) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    *p = malloc(len);
    if (!*p) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    pinned[i].at = (uintptr_t)*p;
    pinned[i].len = len;
    pinned_bytes += len;
    host_allocs++;
    if (pinned_bytes > pinned_peak) pinned_peak = pinned_bytes;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuMemFreeHost(void *p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < 4096; i++) {
        if (pinned[i].at == (uintptr_t)p) {
            pinned_bytes -= pinned[i].len;
            host_frees++;
            pinned[i].at = 0;
            free(p);
            pthread_mutex_unlock(&lock);
            return OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return INVALID_VALUE;
}

static int is_pinned(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < 4096; i++)
        if (pinned[i].at && a >= pinned[i].at && a + len <= pinned[i].at + pinned[i].len) return 1;
    return 0;
}

static size_t capacity(void) {
    const char *m = getenv("FAKE_CUDA_DEVICE_MEMORY");
    return m ? strtoull(m, NULL, 10) : (size_t)1 << 40;
}

struct dalloc { uintptr_t at; size_t len; int device; };
static struct dalloc dallocs[4096];

CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t len) {
    INJECT("cuMemAlloc");
    NEED_CONTEXT();
    int dev = current->device;
    pthread_mutex_lock(&lock);
    size_t i;
    for (i = 0; i < 4096 && dallocs[i].at; i++) {}
    if (i == 4096 || device_now[dev] + len > capacity()) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    void *p = malloc(len ? len : 1);
    if (!p) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    dallocs[i] = (struct dalloc){(uintptr_t)p, len, dev};
    device_now[dev] += len;
    if (device_now[dev] > device_peak) device_peak = device_now[dev];
    pthread_mutex_unlock(&lock);
    *d = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr d) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < 4096; i++) {
        if (dallocs[i].at && dallocs[i].at == (uintptr_t)d) {
            device_now[dallocs[i].device] -= dallocs[i].len;
            dallocs[i].at = 0;
            pthread_mutex_unlock(&lock);
            free((void *)(uintptr_t)d);
            return OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return INVALID_VALUE;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s) {
    NEED_CONTEXT();
    if (!s) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    if (!is_pinned(src, len)) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->ops = realloc(s->ops, s->cap * sizeof(struct op));
    }
    s->ops[s->n++] = (struct op){(void *)(uintptr_t)dst, src, len};
    copies++;
    copied_bytes += len;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    (void)flags;
    NEED_CONTEXT();
    *e = calloc(1, sizeof(struct event_s));
    return *e ? OK : OUT_OF_MEMORY;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    e->stream = s;
    e->mark = s ? s->n : 0;
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuEventSynchronize(CUevent e) {
    INJECT("cuEventSynchronize");
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    if (e->stream) run_until(e->stream, e->mark);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuEventDestroy_v2(CUevent e) { free(e); return OK; }

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    (void)s; (void)e; (void)flags;
    NEED_CONTEXT();
    return OK;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
    switch (r) {
    case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
    case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    default: *s = "CUDA_ERROR_UNKNOWN";
    }
    return OK;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    return cuGetErrorName(r, s);
}
