/*
 * A simulated CUDA driver: a libcuda.so.1 with the driver entry points fastload (src/device/cuda/driver.rs,
 * opened at run time) and its tests call, so that the CUDA engine runs on machines without a GPU.
 * "Device memory" is host memory; a device is a number. Built by tests/cuda_sim.py.
 *
 * It models the driver semantics that the pipeline depends on, so that a pipeline that would
 * corrupt data or fail on a real GPU gives wrong bytes or an error here too:
 *
 * - Contexts. Each device has one primary context (cuDevicePrimaryCtxRetain); a context is
 *   current per thread (cuCtxSetCurrent). Every stream, event, page-locked and device allocation
 *   belongs to the context current when it was created. A call that needs a context with none
 *   current fails with CUDA_ERROR_INVALID_CONTEXT (201). Queuing work (copies, memsets, event
 *   records, stream waits) on a stream of another context than the current one, or recording an
 *   event of one context on a stream of another, fails with CUDA_ERROR_INVALID_HANDLE (400), as
 *   "invalid resource handle" does on a GPU. Synchronising, querying or destroying an object of
 *   another context is allowed (it is in the driver), but needs some context current; so do
 *   cuEventDestroy, cuStreamDestroy, cuMemFree and cuMemFreeHost. cuStreamWaitEvent accepts an
 *   event of another context (the driver documents it).
 * - Late, asynchronous execution. Work queued on a stream runs later, on the simulator's own
 *   thread, in stream order: an operation runs no earlier than FAKE_CUDA_LAG_US microseconds
 *   (default 2000) after it was queued, and a stream carries at most FAKE_CUDA_COPY_RATE bytes a
 *   second (default unlimited), so a busy stream's work lands late. Among operations that may run,
 *   the one due first runs first. So a consumer that reads device memory before waiting for its
 *   copy sees stale bytes, and a staging buffer rewritten before its copy ran sends the new bytes.
 * - Ordering. cuEventRecord marks a point in a stream; cuStreamWaitEvent makes a stream's later
 *   work wait for that point (an event never recorded is no wait, as in the driver). Stream 0 (and
 *   CU_STREAM_LEGACY) is the context's legacy default stream: its work waits for all work queued
 *   before it on the context's blocking streams, and work on a blocking stream waits for the legacy
 *   stream's earlier work; streams created with CU_STREAM_NON_BLOCKING do neither.
 * - Synchronisation. cuStreamSynchronize, cuEventSynchronize and cuCtxSynchronize wait for exactly
 *   the work queued before them (the stream's, the recorded point's, every stream's of the
 *   current context). The synchronous cuMemcpyHtoD/cuMemcpyDtoH run on the legacy stream and
 *   wait; cuMemsetD8 runs on the legacy stream and does not wait (as in the driver). cuMemFree
 *   waits for the context's work first, as the driver does.
 * - Memory. Each device holds FAKE_CUDA_DEVICE_MEMORY bytes (default 1 TiB): cuMemAlloc beyond
 *   that fails with CUDA_ERROR_OUT_OF_MEMORY (2); cuMemAlloc of 0 bytes is
 *   CUDA_ERROR_INVALID_VALUE.
 *   The peak per device is logged. Page-locked memory comes from cuMemHostAlloc, which pins
 *   FAKE_CUDA_PIN_RATE bytes a second (default unlimited), one allocation at a time, as the driver
 *   does (a few GB/s on real machines: a load that pins per run pays it). An async copy
 *   whose host side is not page-locked (or page-locked by another context without
 *   CU_MEMHOSTALLOC_PORTABLE, which the driver then treats as pageable) is carried out
 *   synchronously, as the driver does, and counted as a violation: staging must be page-locked.
 *   A copy into a cuMemAlloc block of another device, or past its end, fails with
 *   CUDA_ERROR_INVALID_VALUE (stricter than the driver, which may go through peer access).
 *   Addresses that are not from cuMemAlloc (tests pass host tensors as destinations) are taken as
 *   memory of some other allocator and not checked.
 *   cuMemFreeHost while queued copies still read or write the buffer fails with
 *   CUDA_ERROR_INVALID_VALUE and the memory stays allocated.
 *   cuMemHostRegister page-locks the caller's memory where it is (FAKE_CUDA_REGISTER_RATE bytes a
 *   second, default unlimited): whole pages only (stricter than the driver); memory mapped
 *   read-only needs CU_MEMHOSTREGISTER_READ_ONLY (the driver would ask the kernel for write
 *   access); a range that overlaps page-locked memory is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
 *   FAKE_CUDA_READ_ONLY_REGISTER=0 plays a device without read-only registration
 *   (CUDA_ERROR_NOT_SUPPORTED for that flag). Registered memory counts as pinned. cuMemHostUnregister
 *   takes FAKE_CUDA_UNREGISTER_US microseconds (default 0); while queued copies still read the
 *   memory it fails like cuMemFreeHost above; of memory not registered it is
 *   CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED.
 * - Flags. cuMemHostAlloc takes PORTABLE|DEVICEMAP|WRITECOMBINED, cuMemHostRegister
 *   PORTABLE|DEVICEMAP|IOMEMORY|READ_ONLY, cuStreamCreate DEFAULT or
 *   NON_BLOCKING, cuEventCreate BLOCKING_SYNC|DISABLE_TIMING|INTERPROCESS (INTERPROCESS only with
 *   DISABLE_TIMING), cuStreamWaitEvent 0 or CU_EVENT_WAIT_EXTERNAL; anything else is
 *   CUDA_ERROR_INVALID_VALUE.
 * - Fork. In a child forked after cuInit, every call fails with CUDA_ERROR_NOT_INITIALIZED (3), as
 *   the real driver's do: cuInit, cuDeviceGetCount and cuCtxSetCurrent in such a child return 3
 *   ("initialization error"; seen on H100s in triton-lang/triton#10443 and TensorFlow #57877).
 *   cuDriverGetVersion, cuGetErrorName and cuGetErrorString work anywhere, as in the driver. A
 *   child forked before cuInit may initialise normally. The child writes no log.
 * - Devices. FAKE_CUDA_DEVICES=N (default 1, at most 16) devices. CUDA_VISIBLE_DEVICES is
 *   honoured like the driver: unset, all; empty, cuInit fails with CUDA_ERROR_NO_DEVICE (100); a
 *   comma list of ordinals, those devices renumbered from 0 (the list ends at the first entry that
 *   is not a valid ordinal).
 * - Held streams (a test control, not the driver's). fake_cuda_hold(stream, ms) keeps the
 *   stream's work from running until fake_cuda_hold(stream, 0), or at most `ms` milliseconds,
 *   after which it runs and a violation is counted (someone waited for the held work): a producer
 *   that is certainly late, however loaded the machine is.
 * - Fault injection. FAKE_CUDA_FAIL=name:n[,name:n...]: the n-th call (1-based) of entry point
 *   `name` (named without its _v2 suffix, e.g. cuMemAlloc, cuEventSynchronize) fails with
 *   CUDA_ERROR_UNKNOWN (999).
 *
 * Every misuse detected (the errors above that are the caller's fault, and the synchronous
 * fallbacks) counts a violation and prints "fake_cuda: violation: ..." to stderr, so that misuse
 * whose error a caller ignores (a destructor's) still shows. At exit, FAKE_CUDA_LOG=path receives
 * one line: copies bytes pinned_peak pinned_now host_allocs host_frees device_peak device_now
 * violations copy_streams (copies and bytes count host-to-device copies, copy_streams the
 * streams that carried any; device_peak is the most bytes allocated at once on any one device),
 * then calls.NAME=N for every entry point called (N calls that got past initialisation and fault
 * injection); fake_cuda_calls() returns those counts in-process, so a test can count what one
 * load costs.
 */
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    NOT_READY = 600,
    HOST_MEMORY_ALREADY_REGISTERED = 712,
    HOST_MEMORY_NOT_REGISTERED = 713,
    NOT_SUPPORTED = 801,
    UNKNOWN = 999,
};

enum { MAX_DEVICES = 16 };
enum { HOST_PORTABLE = 1, HOST_DEVICEMAP = 2, HOST_WRITECOMBINED = 4 };
enum { REGISTER_PORTABLE = 1, REGISTER_DEVICEMAP = 2, REGISTER_IOMEMORY = 4, REGISTER_READ_ONLY = 8 };
enum { STREAM_NON_BLOCKING = 1 };
enum { EVENT_BLOCKING_SYNC = 1, EVENT_DISABLE_TIMING = 2, EVENT_INTERPROCESS = 4 };
#define STREAM_LEGACY ((CUstream)0x1)
#define STREAM_PER_THREAD ((CUstream)0x2)

#define LIVE 0x5151u
#define DEAD 0xdeadu

/* ------------------------------------------------------------------------------------------ */
/* State. One lock guards everything; `work` wakes the executor, `progress` the waiters. */

struct stream_s;

/* An operation waits until `stream` has run its operation number `seq`. */
struct dep { struct stream_s *stream; uint64_t seq; };

struct pinned {
    uintptr_t at;
    size_t len;
    unsigned flags;
    CUcontext ctx;
    size_t pending; /* queued operations that read or write it */
    int registered; /* cuMemHostRegister'ed memory of the caller's, not cuMemHostAlloc'ed */
};

struct op {
    struct op *next;
    uint64_t seq;
    uint64_t due; /* monotonic microseconds: not before then */
    void *dst;
    const void *src; /* NULL: memset to `value` */
    size_t len;
    unsigned char value;
    void *owned;      /* a snapshot of pageable source memory, freed after the copy */
    struct pinned *pin;
    int ndeps;
    struct dep deps[];
};

struct stream_s {
    unsigned magic;
    CUcontext ctx;
    unsigned flags;
    int legacy;
    uint64_t queued, done; /* operations queued and run, numbered from 1 */
    uint64_t busy_until;   /* when the last queued operation finishes (copy rate) */
    struct op *head, *tail;
    uint64_t held_until;       /* fake_cuda_hold: its work waits until then (0: not held) */
    uint64_t copies_to_device; /* host-to-device copies queued on it */
    struct stream_s *next_all; /* every stream with work or a handle, for the executor */
};

struct event_s {
    unsigned magic;
    CUcontext ctx;
    struct stream_s *stream; /* the recorded point: `stream` ran operation `seq` */
    uint64_t seq;
};

struct ctx_s {
    unsigned magic;
    int device;   /* ordinal as the process sees it */
    int physical; /* index into the simulated devices */
    struct stream_s legacy;
};

struct dalloc { uintptr_t at; size_t len; CUcontext ctx; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work, progress;
static volatile int initialised, forked;
static pid_t owner_pid;
static int visible[MAX_DEVICES], nvisible;
static struct ctx_s contexts[MAX_DEVICES]; /* primary contexts, by physical device */
static __thread CUcontext current;
static struct stream_s *all_streams;
static struct pinned **pins;
static size_t npins, cap_pins;
static struct dalloc *dallocs;
static size_t ndallocs, cap_dallocs;
static uint64_t lag_us = 2000, copy_rate, pin_rate, register_rate; /* bytes/s, 0: unlimited */
static size_t device_capacity = (size_t)1 << 40;

static unsigned long long copies, copied_bytes, host_allocs, host_frees, violations;
static unsigned long long copy_streams; /* streams that carried copies to a device */
static size_t pinned_now, pinned_peak, device_now[MAX_DEVICES], device_peak;

static uint64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
}

/* Counts a misuse, says what it was on stderr, and returns `code` for the caller to return. */
static CUresult violation(CUresult code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char text[512];
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    __atomic_add_fetch(&violations, 1, __ATOMIC_RELAXED);
    fprintf(stderr, "fake_cuda: violation: %s\n", text);
    return code;
}

static unsigned long long env_number(const char *name, unsigned long long fallback) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : fallback;
}

/* FAKE_CUDA_FAIL=name:n[,name:n]: whether this call of `name` is the one to fail. */
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

/* Calls per entry point (those that pass ENTER), for tests that count what a load costs:
 * written to FAKE_CUDA_LOG as calls.NAME=N and readable in-process with fake_cuda_calls(). */
enum { MAX_CALLED = 64 };
static struct { const char *name; unsigned long long n; } called[MAX_CALLED];

static void count_call(const char *name) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_CALLED; i++) {
        if (!called[i].name) called[i].name = name;
        if (called[i].name == name || !strcmp(called[i].name, name)) {
            called[i].n++;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}

/* Writes "NAME=N NAME=N ..." (every entry point called so far) into buf; returns its length. */
int fake_cuda_calls(char *buf, size_t len) {
    size_t at = 0;
    if (len) buf[0] = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_CALLED && called[i].name && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s=%llu", at ? " " : "", called[i].name,
                               called[i].n);
    pthread_mutex_unlock(&lock);
    return (int)(at < len ? at : len);
}

/* Every entry point but the version and error texts starts here. */
#define ENTER(name)                                               \
    do {                                                          \
        if (forked || !initialised) return NOT_INITIALIZED;       \
        if (injected(name)) return UNKNOWN;                       \
        count_call(name);                                         \
    } while (0)

#define LIVE_EVENT(e, name)                                                          \
    do {                                                                             \
        if (!(e) || (e)->magic != LIVE)                                              \
            return violation(INVALID_HANDLE, "%s of a destroyed event", name);       \
    } while (0)

#define NEED_CONTEXT(name)                                                         \
    do {                                                                           \
        ENTER(name);                                                               \
        if (!current) return violation(INVALID_CONTEXT, "%s with no current context", name); \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Memory tables (caller holds the lock). */

static struct pinned *pinned_at(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < npins; i++)
        if (a >= pins[i]->at && a + len <= pins[i]->at + pins[i]->len) return pins[i];
    return NULL;
}

/* Records page-locked memory (caller holds the lock). */
static void add_pin(struct pinned *pin) {
    if (npins == cap_pins) {
        cap_pins = cap_pins ? 2 * cap_pins : 64;
        pins = realloc(pins, cap_pins * sizeof *pins);
    }
    pins[npins++] = pin;
    pinned_now += pin->len;
    if (pinned_now > pinned_peak) pinned_peak = pinned_now;
}

static struct dalloc *device_at(CUdeviceptr d) {
    for (size_t i = 0; i < ndallocs; i++)
        if (d >= dallocs[i].at && d < dallocs[i].at + (dallocs[i].len ? dallocs[i].len : 1))
            return &dallocs[i];
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and the executor. */

static int is_done(const struct dep *d) { return d->stream->done >= d->seq; }

static int ready(const struct op *o) {
    for (int i = 0; i < o->ndeps; i++)
        if (!is_done(&o->deps[i])) return 0;
    return 1;
}

static void run(struct stream_s *s) {
    struct op *o = s->head;
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    if (o->src) memcpy(o->dst, o->src, o->len);
    else if (o->len) memset(o->dst, o->value, o->len);
    if (o->pin) o->pin->pending--;
    s->done = o->seq;
    free(o->owned);
    free(o);
}

/* The simulator's thread: runs, one at a time, the due operation that was due first. */
static void *executor(void *arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        uint64_t now = now_us(), next = UINT64_MAX;
        struct stream_s *pick = NULL;
        for (struct stream_s **link = &all_streams; *link;) {
            struct stream_s *s = *link;
            if (s->magic == DEAD && !s->head) { /* destroyed and drained: forget it */
                *link = s->next_all;
                continue;
            }
            link = &s->next_all;
            if (s->held_until && s->head) {
                if (s->held_until > now) {
                    if (s->held_until < next) next = s->held_until;
                    continue;
                }
                s->held_until = 0;
                violation(OK, "a held stream's work ran at the hold's deadline (fake_cuda_hold): "
                          "something waited for it");
            }
            if (!s->head || !ready(s->head)) continue;
            if (s->head->due <= now) {
                if (!pick || s->head->due < pick->head->due) pick = s;
            } else if (s->head->due < next) {
                next = s->head->due;
            }
        }
        if (pick) {
            run(pick);
            pthread_cond_broadcast(&progress);
        } else if (next == UINT64_MAX) {
            pthread_cond_wait(&work, &lock);
        } else {
            struct timespec t = {(time_t)(next / 1000000u), (long)(next % 1000000u) * 1000};
            pthread_cond_timedwait(&work, &lock, &t);
        }
    }
    return NULL;
}

static void wait_for(struct stream_s *s, uint64_t seq) {
    while (s->done < seq) pthread_cond_wait(&progress, &lock);
}

/* Waits for the work queued so far on every stream of `ctx` (caller holds the lock). Streams
 * are never freed, so the snapshot stays valid while the lock is released. */
static void wait_context(CUcontext ctx) {
    size_t n = 0, i = 0;
    for (struct stream_s *s = all_streams; s; s = s->next_all) n++;
    struct dep *todo = calloc(n + 1, sizeof *todo);
    for (struct stream_s *s = all_streams; s; s = s->next_all)
        if (s->ctx == ctx && s->done < s->queued) todo[i++] = (struct dep){s, s->queued};
    while (i--) wait_for(todo[i].stream, todo[i].seq);
    free(todo);
}

/* Queues an operation on `s` (caller holds the lock), with the legacy-stream ordering and `extra`
 * (a stream wait) as dependencies; returns its number in the stream. */
static uint64_t enqueue(struct stream_s *s, void *dst, const void *src, size_t len,
                        unsigned char value, int data, struct dep *extra) {
    int n = 1;
    for (struct stream_s *t = all_streams; t; t = t->next_all) n++;
    struct op *o = calloc(1, sizeof *o + n * sizeof(struct dep));
    if (extra && !is_done(extra)) o->deps[o->ndeps++] = *extra;
    if (s->legacy) {
        for (struct stream_s *t = all_streams; t; t = t->next_all)
            if (t->ctx == s->ctx && !t->legacy && !(t->flags & STREAM_NON_BLOCKING) &&
                t->done < t->queued)
                o->deps[o->ndeps++] = (struct dep){t, t->queued};
    } else if (!(s->flags & STREAM_NON_BLOCKING)) {
        struct stream_s *l = &s->ctx->legacy;
        if (l->done < l->queued) o->deps[o->ndeps++] = (struct dep){l, l->queued};
    }
    o->dst = dst;
    o->src = src;
    o->len = len;
    o->value = value;
    o->seq = ++s->queued;
    if (data) {
        uint64_t start = now_us() + lag_us;
        if (start < s->busy_until) start = s->busy_until;
        o->due = start + (copy_rate ? (uint64_t)((double)len * 1e6 / (double)copy_rate) : 0);
        s->busy_until = o->due;
    }
    if (s->tail) s->tail->next = o;
    else s->head = o;
    s->tail = o;
    pthread_cond_signal(&work);
    return o->seq;
}

/* Test control, not a driver entry point: stream `h`'s work (already queued or queued later) runs
 * only after fake_cuda_hold(h, 0), or at the latest `ms` milliseconds from now, which counts a
 * violation (a caller waited for held work). So a test can make a producer certainly late,
 * whatever the machine's load. Returns 0, or INVALID_HANDLE for a stream that is not live. */
int fake_cuda_hold(CUstream h, unsigned ms) {
    pthread_mutex_lock(&lock);
    struct stream_s *s = h && h != STREAM_LEGACY && h != STREAM_PER_THREAD && h->magic == LIVE
                             ? h
                             : NULL;
    if (s) s->held_until = ms ? now_us() + (uint64_t)ms * 1000u : 0;
    pthread_cond_signal(&work);
    pthread_mutex_unlock(&lock);
    return s ? OK : INVALID_HANDLE;
}

/* The stream a handle names for work queued from this thread, or NULL (an error was counted). */
static struct stream_s *work_stream(CUstream h, const char *name, CUresult *err) {
    if (h == NULL || h == STREAM_LEGACY || h == STREAM_PER_THREAD) return &current->legacy;
    if (h->magic != LIVE) {
        *err = violation(INVALID_HANDLE, "%s on a destroyed stream", name);
        return NULL;
    }
    if (h->ctx != current) {
        *err = violation(INVALID_HANDLE, "%s on a stream of device %d while device %d's context "
                         "is current", name, h->ctx->device, current->device);
        return NULL;
    }
    return h;
}

/* A stream named by a handle for synchronisation: any context's. */
static struct stream_s *any_stream(CUstream h) {
    if (h == NULL || h == STREAM_LEGACY || h == STREAM_PER_THREAD) return &current->legacy;
    return h->magic == LIVE ? h : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Initialisation, devices, contexts. */

static void report(void) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (!path || forked || getpid() != owner_pid) return;
    pthread_mutex_lock(&lock);
    size_t now = 0;
    for (int d = 0; d < MAX_DEVICES; d++) now += device_now[d];
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f,
                "copies=%llu bytes=%llu pinned_peak=%zu pinned_now=%zu host_allocs=%llu "
                "host_frees=%llu device_peak=%zu device_now=%zu violations=%llu "
                "copy_streams=%llu",
                copies, copied_bytes, pinned_peak, pinned_now, host_allocs, host_frees,
                device_peak, now, violations, copy_streams);
        for (int i = 0; i < MAX_CALLED && called[i].name; i++)
            fprintf(f, " calls.%s=%llu", called[i].name, called[i].n);
        fputc('\n', f);
        fclose(f);
    }
    pthread_mutex_unlock(&lock);
}

static void in_child(void) {
    if (initialised) forked = 1;
}

/* CUDA_VISIBLE_DEVICES: a comma list of ordinals, ending at the first that is not one. */
static void find_devices(void) {
    int physical = (int)env_number("FAKE_CUDA_DEVICES", 1);
    if (physical > MAX_DEVICES) physical = MAX_DEVICES;
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    nvisible = 0;
    if (!v) {
        for (int d = 0; d < physical; d++) visible[nvisible++] = d;
        return;
    }
    for (const char *p = v; *p && nvisible < MAX_DEVICES;) {
        char *end;
        long d = strtol(p, &end, 10);
        if (end == p || d < 0 || d >= physical) break;
        visible[nvisible++] = (int)d;
        if (*end != ',') break;
        p = end + 1;
    }
}

CUresult cuInit(unsigned flags) {
    if (forked) return NOT_INITIALIZED;
    if (injected("cuInit")) return UNKNOWN;
    if (flags != 0) return violation(INVALID_VALUE, "cuInit flags %u (must be 0)", flags);
    pthread_mutex_lock(&lock);
    if (!initialised) {
        find_devices();
        if (!nvisible) { /* CUDA_VISIBLE_DEVICES="" or naming no device */
            pthread_mutex_unlock(&lock);
            return NO_DEVICE;
        }
        lag_us = env_number("FAKE_CUDA_LAG_US", 2000);
        copy_rate = env_number("FAKE_CUDA_COPY_RATE", 0);
        pin_rate = env_number("FAKE_CUDA_PIN_RATE", 0);
        register_rate = env_number("FAKE_CUDA_REGISTER_RATE", 0);
        device_capacity = env_number("FAKE_CUDA_DEVICE_MEMORY", (size_t)1 << 40);
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&work, &attr);
        pthread_cond_init(&progress, NULL);
        pthread_t t;
        pthread_create(&t, NULL, executor, NULL);
        pthread_detach(t);
        owner_pid = getpid();
        pthread_atfork(NULL, NULL, in_child);
        atexit(report);
        initialised = 1;
    }
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuDriverGetVersion(int *v) {
    if (!v) return INVALID_VALUE;
    *v = 12080;
    return OK;
}

CUresult cuDeviceGetCount(int *n) {
    ENTER("cuDeviceGetCount");
    if (!n) return INVALID_VALUE;
    *n = nvisible;
    return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER("cuDeviceGet");
    if (ordinal < 0 || ordinal >= nvisible) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (d < 0 || d >= nvisible) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    struct ctx_s *ctx = &contexts[visible[d]];
    if (ctx->magic != LIVE) {
        ctx->magic = LIVE;
        ctx->device = d;
        ctx->physical = visible[d];
        ctx->legacy = (struct stream_s){.magic = LIVE, .ctx = ctx, .legacy = 1};
        ctx->legacy.next_all = all_streams;
        all_streams = &ctx->legacy;
    }
    pthread_mutex_unlock(&lock);
    *c = ctx;
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    ENTER("cuDevicePrimaryCtxRelease");
    return d >= 0 && d < nvisible ? OK : INVALID_DEVICE;
}

static int is_context(CUcontext c) {
    return c >= contexts && c < contexts + MAX_DEVICES && c->magic == LIVE;
}

CUresult cuCtxSetCurrent(CUcontext c) {
    ENTER("cuCtxSetCurrent");
    if (c && !is_context(c)) return violation(INVALID_CONTEXT, "cuCtxSetCurrent of no context");
    current = c;
    return OK;
}

CUresult cuCtxGetCurrent(CUcontext *c) {
    ENTER("cuCtxGetCurrent");
    *c = current;
    return OK;
}

CUresult cuCtxGetDevice(CUdevice *d) {
    NEED_CONTEXT("cuCtxGetDevice");
    *d = current->device;
    return OK;
}

CUresult cuCtxSynchronize(void) {
    NEED_CONTEXT("cuCtxSynchronize");
    pthread_mutex_lock(&lock);
    wait_context(current);
    pthread_mutex_unlock(&lock);
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and events. */

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    NEED_CONTEXT("cuStreamCreate");
    if (flags & ~(unsigned)STREAM_NON_BLOCKING)
        return violation(INVALID_VALUE, "cuStreamCreate flags %#x", flags);
    struct stream_s *n = calloc(1, sizeof *n);
    if (!n) return OUT_OF_MEMORY;
    n->magic = LIVE;
    n->ctx = current;
    n->flags = flags;
    pthread_mutex_lock(&lock);
    n->next_all = all_streams;
    all_streams = n;
    pthread_mutex_unlock(&lock);
    *s = n;
    return OK;
}

CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int priority) {
    (void)priority;
    return cuStreamCreate(s, flags);
}

/* Destroyed streams stay allocated (marked dead): operations ordered after them read their
 * progress. The executor drops them from its list once they ran their work. */
CUresult cuStreamDestroy_v2(CUstream h) {
    NEED_CONTEXT("cuStreamDestroy");
    if (h == NULL || h == STREAM_LEGACY || h == STREAM_PER_THREAD || h->magic != LIVE)
        return violation(INVALID_HANDLE, "cuStreamDestroy of %s",
                         h ? "a destroyed stream" : "stream 0");
    pthread_mutex_lock(&lock);
    h->magic = DEAD;
    pthread_cond_signal(&work);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuStreamSynchronize(CUstream h) {
    NEED_CONTEXT("cuStreamSynchronize");
    struct stream_s *s = any_stream(h);
    if (!s) return violation(INVALID_HANDLE, "cuStreamSynchronize of a destroyed stream");
    pthread_mutex_lock(&lock);
    wait_for(s, s->queued);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuStreamQuery(CUstream h) {
    NEED_CONTEXT("cuStreamQuery");
    struct stream_s *s = any_stream(h);
    if (!s) return violation(INVALID_HANDLE, "cuStreamQuery of a destroyed stream");
    pthread_mutex_lock(&lock);
    CUresult r = s->done < s->queued ? NOT_READY : OK;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    NEED_CONTEXT("cuEventCreate");
    unsigned known = EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS;
    if ((flags & ~known) || ((flags & EVENT_INTERPROCESS) && !(flags & EVENT_DISABLE_TIMING)))
        return violation(INVALID_VALUE, "cuEventCreate flags %#x", flags);
    struct event_s *n = calloc(1, sizeof *n);
    if (!n) return OUT_OF_MEMORY;
    n->magic = LIVE;
    n->ctx = current;
    *e = n;
    return OK;
}

/* Destroyed events stay allocated (marked dead), so that a later use is an error, not a crash. */
CUresult cuEventDestroy_v2(CUevent e) {
    NEED_CONTEXT("cuEventDestroy");
    LIVE_EVENT(e, "cuEventDestroy");
    e->magic = DEAD;
    return OK;
}

CUresult cuEventRecord(CUevent e, CUstream h) {
    NEED_CONTEXT("cuEventRecord");
    LIVE_EVENT(e, "cuEventRecord");
    CUresult err = OK;
    pthread_mutex_lock(&lock);
    struct stream_s *s = work_stream(h, "cuEventRecord", &err);
    if (s && e->ctx != s->ctx)
        err = violation(INVALID_HANDLE, "cuEventRecord of device %d's event on device %d's stream",
                        e->ctx->device, s->ctx->device);
    if (!err) { /* a point in the stream, after the legacy ordering its work has */
        e->stream = s;
        e->seq = enqueue(s, NULL, NULL, 0, 0, 0, NULL);
    }
    pthread_mutex_unlock(&lock);
    return err;
}

CUresult cuEventSynchronize(CUevent e) {
    NEED_CONTEXT("cuEventSynchronize");
    LIVE_EVENT(e, "cuEventSynchronize");
    pthread_mutex_lock(&lock);
    if (e->stream) wait_for(e->stream, e->seq);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuEventQuery(CUevent e) {
    NEED_CONTEXT("cuEventQuery");
    LIVE_EVENT(e, "cuEventQuery");
    pthread_mutex_lock(&lock);
    CUresult r = e->stream && e->stream->done < e->seq ? NOT_READY : OK;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned flags) {
    NEED_CONTEXT("cuStreamWaitEvent");
    if (flags > 1) return violation(INVALID_VALUE, "cuStreamWaitEvent flags %#x", flags);
    LIVE_EVENT(e, "cuStreamWaitEvent");
    CUresult err = OK;
    pthread_mutex_lock(&lock);
    struct stream_s *s = work_stream(h, "cuStreamWaitEvent", &err);
    if (s && e->stream) {
        struct dep d = {e->stream, e->seq};
        enqueue(s, NULL, NULL, 0, 0, 0, &d);
    }
    pthread_mutex_unlock(&lock);
    return err;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory. */

CUresult cuMemHostAlloc(void **p, size_t len, unsigned flags) {
    NEED_CONTEXT("cuMemHostAlloc");
    if (flags & ~(unsigned)(HOST_PORTABLE | HOST_DEVICEMAP | HOST_WRITECOMBINED))
        return violation(INVALID_VALUE, "cuMemHostAlloc flags %#x", flags);
    if (pin_rate) { /* pinning takes time, one allocation at a time, as in the driver */
        static pthread_mutex_t pinning = PTHREAD_MUTEX_INITIALIZER;
        uint64_t us = (uint64_t)((double)len * 1e6 / (double)pin_rate);
        struct timespec t = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000};
        pthread_mutex_lock(&pinning);
        nanosleep(&t, NULL);
        pthread_mutex_unlock(&pinning);
    }
    struct pinned *pin = calloc(1, sizeof *pin);
    /* Whole pages, as the driver's page-locked memory is (reads around the page cache need it). */
    void *mem = NULL;
    if (posix_memalign(&mem, (size_t)sysconf(_SC_PAGESIZE), len ? len : 1) != 0) mem = NULL;
    if (!pin || !mem) {
        free(pin);
        free(mem);
        return OUT_OF_MEMORY;
    }
    *pin = (struct pinned){(uintptr_t)mem, len, flags, current, 0, 0};
    pthread_mutex_lock(&lock);
    add_pin(pin);
    host_allocs++;
    pthread_mutex_unlock(&lock);
    *p = mem;
    return OK;
}

CUresult cuMemAllocHost_v2(void **p, size_t len) { return cuMemHostAlloc(p, len, 0); }

CUresult cuMemFreeHost(void *p) {
    NEED_CONTEXT("cuMemFreeHost");
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < npins; i++) {
        struct pinned *pin = pins[i];
        if (pin->at != (uintptr_t)p) continue;
        if (pin->registered) {
            pthread_mutex_unlock(&lock);
            return violation(INVALID_VALUE, "cuMemFreeHost of memory from cuMemHostRegister");
        }
        if (pin->pending) {
            size_t pending = pin->pending;
            pthread_mutex_unlock(&lock);
            return violation(INVALID_VALUE,
                             "cuMemFreeHost of page-locked memory that %zu queued copies still use",
                             pending);
        }
        pins[i] = pins[--npins];
        pinned_now -= pin->len;
        host_frees++;
        pthread_mutex_unlock(&lock);
        free((void *)pin->at);
        free(pin);
        return OK;
    }
    pthread_mutex_unlock(&lock);
    return violation(INVALID_VALUE, "cuMemFreeHost of memory not from cuMemHostAlloc");
}

/* Whether every page of [a, a + len) is mapped writable (/proc/self/maps). */
static int writable(uintptr_t a, size_t len) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 1;
    char line[512];
    int ok = 1;
    while (ok && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
        if (hi > a && lo < a + len && perms[1] != 'w') ok = 0;
    }
    fclose(f);
    return ok;
}

CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    NEED_CONTEXT("cuMemHostRegister");
    unsigned known = REGISTER_PORTABLE | REGISTER_DEVICEMAP | REGISTER_IOMEMORY | REGISTER_READ_ONLY;
    if (flags & ~known) return violation(INVALID_VALUE, "cuMemHostRegister flags %#x", flags);
    long page = sysconf(_SC_PAGESIZE);
    if (!p || !len || (uintptr_t)p % (uintptr_t)page || len % (size_t)page)
        return violation(INVALID_VALUE, "cuMemHostRegister of %zu bytes at %p: not whole pages",
                         len, p);
    /* A device without CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED. */
    if ((flags & REGISTER_READ_ONLY) && env_number("FAKE_CUDA_READ_ONLY_REGISTER", 1) == 0)
        return NOT_SUPPORTED;
    if (!(flags & REGISTER_READ_ONLY) && !writable((uintptr_t)p, len))
        return violation(INVALID_VALUE,
                         "cuMemHostRegister of read-only memory without "
                         "CU_MEMHOSTREGISTER_READ_ONLY");
    /* The driver faults every page in and pins it: a page that cannot be (a file's past its
     * end) fails the call. */
    if (madvise(p, len, 22 /* MADV_POPULATE_READ */) != 0 && errno == EFAULT)
        return INVALID_VALUE;
    if (register_rate) { /* page-locking takes time */
        uint64_t us = (uint64_t)((double)len * 1e6 / (double)register_rate);
        struct timespec t = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000};
        nanosleep(&t, NULL);
    }
    struct pinned *pin = calloc(1, sizeof *pin);
    if (!pin) return OUT_OF_MEMORY;
    *pin = (struct pinned){(uintptr_t)p, len, flags, current, 0, 1};
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < npins; i++)
        if (pins[i]->at < pin->at + len && pin->at < pins[i]->at + pins[i]->len) {
            pthread_mutex_unlock(&lock);
            free(pin);
            return violation(HOST_MEMORY_ALREADY_REGISTERED,
                             "cuMemHostRegister of %zu bytes at %p: already page-locked", len, p);
        }
    add_pin(pin);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuMemHostUnregister(void *p) {
    NEED_CONTEXT("cuMemHostUnregister");
    uint64_t us = env_number("FAKE_CUDA_UNREGISTER_US", 0); /* unpinning takes time */
    if (us) {
        struct timespec t = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000};
        nanosleep(&t, NULL);
    }
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < npins; i++) {
        struct pinned *pin = pins[i];
        if (pin->at != (uintptr_t)p || !pin->registered) continue;
        if (pin->pending) {
            size_t pending = pin->pending;
            pthread_mutex_unlock(&lock);
            return violation(INVALID_VALUE,
                             "cuMemHostUnregister of memory that %zu queued copies still read",
                             pending);
        }
        pins[i] = pins[--npins];
        pinned_now -= pin->len;
        pthread_mutex_unlock(&lock);
        free(pin);
        return OK;
    }
    pthread_mutex_unlock(&lock);
    return violation(HOST_MEMORY_NOT_REGISTERED, "cuMemHostUnregister of %p: not registered", p);
}

CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t len) {
    NEED_CONTEXT("cuMemAlloc");
    if (len == 0) return INVALID_VALUE;
    int dev = current->physical;
    pthread_mutex_lock(&lock);
    if (device_now[dev] + len > device_capacity) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    void *p = malloc(len);
    if (!p) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    if (ndallocs == cap_dallocs) {
        cap_dallocs = cap_dallocs ? 2 * cap_dallocs : 64;
        dallocs = realloc(dallocs, cap_dallocs * sizeof *dallocs);
    }
    dallocs[ndallocs++] = (struct dalloc){(uintptr_t)p, len, current};
    device_now[dev] += len;
    if (device_now[dev] > device_peak) device_peak = device_now[dev];
    pthread_mutex_unlock(&lock);
    *d = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr d) {
    NEED_CONTEXT("cuMemFree");
    pthread_mutex_lock(&lock);
    struct dalloc *a = device_at(d);
    if (!a || a->at != d) {
        pthread_mutex_unlock(&lock);
        return violation(INVALID_VALUE, "cuMemFree of %#llx, not from cuMemAlloc", d);
    }
    CUcontext owner = a->ctx;
    wait_context(owner); /* like the driver: the context's queued work finishes first */
    a = device_at(d);
    device_now[owner->physical] -= a->len;
    *a = dallocs[--ndallocs];
    pthread_mutex_unlock(&lock);
    free((void *)(uintptr_t)d);
    return OK;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    NEED_CONTEXT("cuMemGetInfo");
    pthread_mutex_lock(&lock);
    *total = device_capacity;
    *free_bytes = device_capacity - device_now[current->physical];
    pthread_mutex_unlock(&lock);
    return OK;
}

/* Checks the device side of a copy or memset (caller holds the lock). */
static CUresult check_device(CUdeviceptr d, size_t len, struct stream_s *s, const char *name) {
    struct dalloc *a = device_at(d);
    if (!a) return OK; /* another allocator's memory (tests: host tensors) */
    if (a->ctx->physical != s->ctx->physical)
        return violation(INVALID_VALUE, "%s with device %d's memory on device %d's stream", name,
                         a->ctx->device, s->ctx->device);
    if (d + len > a->at + a->len)
        return violation(INVALID_VALUE, "%s of %zu bytes past the end of a %zu-byte allocation",
                         name, len, a->len);
    return OK;
}

/* The page-locked block holding host memory [p, p+len) as this context sees it, or NULL. */
static struct pinned *page_locked(const void *p, size_t len) {
    struct pinned *pin = pinned_at(p, len);
    if (pin && pin->ctx != current && !(pin->flags & HOST_PORTABLE)) return NULL;
    return pin;
}

/* Queues a copy (or memset when `src` is NULL) on stream handle `h`; waits for it when `sync`.
 * `host` is the host side of a copy, `to_device` its direction. */
static CUresult transfer(const char *name, CUstream h, void *dst, const void *src, size_t len,
                         unsigned char value, CUdeviceptr device, const void *host, int to_device,
                         int sync) {
    CUresult err = OK;
    pthread_mutex_lock(&lock);
    struct stream_s *s = work_stream(h, name, &err);
    if (s) err = check_device(device, len, s, name);
    if (err) {
        pthread_mutex_unlock(&lock);
        return err;
    }
    struct pinned *pin = host ? page_locked(host, len) : NULL;
    void *owned = NULL;
    if (host && !pin && !sync) {
        /* The driver copies pageable memory synchronously; staging should be page-locked. */
        violation(OK, "%s with host memory that is not page-locked (synchronous on a GPU)", name);
        if (to_device) {
            owned = malloc(len ? len : 1);
            memcpy(owned, src, len);
            src = owned;
        } else {
            sync = 1;
        }
    }
    uint64_t seq = enqueue(s, dst, src, len, value, 1, NULL);
    struct op *o = s->tail;
    o->owned = owned;
    o->pin = pin;
    if (pin) pin->pending++;
    if (to_device && src) {
        copies++;
        copied_bytes += len;
        if (s->copies_to_device++ == 0) copy_streams++;
    }
    if (sync) wait_for(s, seq);
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream h) {
    NEED_CONTEXT("cuMemcpyHtoDAsync");
    return transfer("cuMemcpyHtoDAsync", h, (void *)(uintptr_t)dst, src, len, 0, dst, src, 1, 0);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t len, CUstream h) {
    NEED_CONTEXT("cuMemcpyDtoHAsync");
    const void *from = (const void *)(uintptr_t)src;
    return transfer("cuMemcpyDtoHAsync", h, dst, from, len, 0, src, dst, 0, 0);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
    NEED_CONTEXT("cuMemcpyHtoD");
    return transfer("cuMemcpyHtoD", NULL, (void *)(uintptr_t)dst, src, len, 0, dst, src, 1, 1);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
    NEED_CONTEXT("cuMemcpyDtoH");
    const void *from = (const void *)(uintptr_t)src;
    return transfer("cuMemcpyDtoH", NULL, dst, from, len, 0, src, dst, 0, 1);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream h) {
    NEED_CONTEXT("cuMemsetD8Async");
    return transfer("cuMemsetD8Async", h, (void *)(uintptr_t)dst, NULL, n, value, dst, NULL, 0, 0);
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    NEED_CONTEXT("cuMemsetD8");
    return transfer("cuMemsetD8", NULL, (void *)(uintptr_t)dst, NULL, n, value, dst, NULL, 0, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Error texts, for every code returned above (the driver's wording). */

static const struct { CUresult code; const char *name, *text; } errors[] = {
    {OK, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_text(CUresult r, const char **s, int name) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == r) {
            *s = name ? errors[i].name : errors[i].text;
            return OK;
        }
    *s = NULL;
    return INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult r, const char **s) { return error_text(r, s, 1); }
CUresult cuGetErrorString(CUresult r, const char **s) { return error_text(r, s, 0); }
