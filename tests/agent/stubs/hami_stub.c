/* A stand-in for HAMi-core's libvgpu.so, for tests of the CUDA probe: an LD_PRELOAD library that
 * enforces CUDA_DEVICE_MEMORY_LIMIT the way HAMi-core does, by intercepting the driver's calls.
 *
 * The limit: a number with suffix k, m or g (any case: KiB, MiB, GiB); a plain number is MiB too (real
 * HAMi-core reads it as bytes; the probe always writes a suffix). Unset or unreadable: no limit, every
 * call passes through.
 *
 * What it intercepts, and how a process reaches it:
 * - cuMemGetInfo_v2 (total = the limit, free = the limit less what this process allocated, each at most
 *   the driver's), cuMemAlloc_v2 (refused with CUDA_ERROR_OUT_OF_MEMORY past the limit) and cuMemFree_v2
 *   wrap the next library's functions, found with the real dlsym(RTLD_NEXT, ...);
 * - dlsym itself: a lookup of those names, or of cuGetProcAddress(_v2), on any handle that has them
 *   returns the wrappers (the real dlsym comes from dlvsym(RTLD_NEXT, "dlsym", <glibc version>); a caller's own
 *   RTLD_NEXT lookup through it resolves relative to this library, as with HAMi-core);
 * - cuGetProcAddress_v2 and cuGetProcAddress: the driver answers, then the names above ("cuMemAlloc",
 *   or "cuMemAlloc_v2") are replaced by the wrappers.
 *
 * Built with default visibility it enforces the limit; built with -fvisibility=hidden it exports nothing,
 * so nothing reaches it and it enforces nothing (the broken release build seen on a real node).
 * Single-threaded on purpose, like the probe.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef int CUdriverProcAddressQueryResult;

typedef CUresult (*memory_info_fn)(size_t *, size_t *);
typedef CUresult (*memory_allocate_fn)(CUdeviceptr *, size_t);
typedef CUresult (*memory_free_fn)(CUdeviceptr);
typedef CUresult (*proc_address_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*proc_address_fn)(const char *, void **, int, cuuint64_t);
typedef void *(*dlsym_fn)(void *, const char *);

enum { SUCCESS = 0, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3 };

#define MIB (1024ULL * 1024ULL)
#define SLOTS 256

static dlsym_fn real_dlsym;
static int limit_read;
static unsigned long long limit_bytes; /* 0: no limit */
static unsigned long long used_bytes;
static struct {
    CUdeviceptr pointer;
    unsigned long long bytes;
} slots[SLOTS];

static dlsym_fn the_real_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; real_dlsym == NULL && i < sizeof versions / sizeof versions[0]; i++)
        real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    return real_dlsym;
}

/* The next library's `name` (libcuda's, behind this one). */
static void *next(const char *name) {
    dlsym_fn lookup = the_real_dlsym();
    return lookup == NULL ? NULL : lookup(RTLD_NEXT, name);
}

static unsigned long long limit(void) {
    if (!limit_read) {
        limit_read = 1;
        const char *text = getenv("CUDA_DEVICE_MEMORY_LIMIT");
        if (text != NULL && *text != '\0') {
            char *end = NULL;
            unsigned long long value = strtoull(text, &end, 10);
            unsigned long long unit = MIB;
            switch (*end) {
            case 'K': case 'k': unit = 1024ULL; end++; break;
            case 'M': case 'm': unit = MIB; end++; break;
            case 'G': case 'g': unit = 1024ULL * MIB; end++; break;
            default: break;
            }
            if (end != text && *end == '\0')
                limit_bytes = value * unit;
        }
    }
    return limit_bytes;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    memory_info_fn driver = (memory_info_fn)next("cuMemGetInfo_v2");
    if (driver == NULL)
        return NOT_INITIALIZED;
    CUresult result = driver(free_bytes, total);
    unsigned long long cap = limit();
    if (result != SUCCESS || cap == 0)
        return result;
    unsigned long long left = cap > used_bytes ? cap - used_bytes : 0;
    if (*total > cap)
        *total = (size_t)cap;
    if (*free_bytes > left)
        *free_bytes = (size_t)left;
    return SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *pointer, size_t bytes) {
    memory_allocate_fn driver = (memory_allocate_fn)next("cuMemAlloc_v2");
    if (driver == NULL)
        return NOT_INITIALIZED;
    unsigned long long cap = limit();
    if (cap == 0)
        return driver(pointer, bytes);
    if (used_bytes + bytes > cap)
        return OUT_OF_MEMORY;
    int slot = -1;
    for (int i = 0; i < SLOTS && slot < 0; i++)
        if (slots[i].pointer == 0)
            slot = i;
    if (slot < 0)
        return OUT_OF_MEMORY;
    CUresult result = driver(pointer, bytes);
    if (result == SUCCESS) {
        slots[slot].pointer = *pointer;
        slots[slot].bytes = bytes;
        used_bytes += bytes;
    }
    return result;
}

CUresult cuMemFree_v2(CUdeviceptr pointer) {
    memory_free_fn driver = (memory_free_fn)next("cuMemFree_v2");
    if (driver == NULL)
        return NOT_INITIALIZED;
    CUresult result = driver(pointer);
    if (result == SUCCESS) {
        for (int i = 0; i < SLOTS; i++) {
            if (pointer != 0 && slots[i].pointer == pointer) {
                used_bytes -= slots[i].bytes;
                slots[i].pointer = 0;
                slots[i].bytes = 0;
                break;
            }
        }
    }
    return result;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **function, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status);
CUresult cuGetProcAddress(const char *symbol, void **function, int cuda_version, cuuint64_t flags);

/* This library's replacement for `name` (a base name or a versioned one); NULL when it has none. */
static void *hook(const char *name) {
    if (strcmp(name, "cuMemGetInfo") == 0 || strcmp(name, "cuMemGetInfo_v2") == 0)
        return (void *)cuMemGetInfo_v2;
    if (strcmp(name, "cuMemAlloc") == 0 || strcmp(name, "cuMemAlloc_v2") == 0)
        return (void *)cuMemAlloc_v2;
    if (strcmp(name, "cuMemFree") == 0 || strcmp(name, "cuMemFree_v2") == 0)
        return (void *)cuMemFree_v2;
    if (strcmp(name, "cuGetProcAddress_v2") == 0)
        return (void *)cuGetProcAddress_v2;
    if (strcmp(name, "cuGetProcAddress") == 0)
        return (void *)cuGetProcAddress;
    return NULL;
}

/* What the driver's cuGetProcAddress found for `symbol`, replaced by this library's wrapper if it has one
 * (the base name "cuGetProcAddress" means the _v2 variant from CUDA 12.0 on, as in the driver). */
static void replace(const char *symbol, void **function, int cuda_version) {
    if (symbol == NULL || function == NULL)
        return;
    void *replacement = hook(symbol);
    if (replacement == (void *)cuGetProcAddress && cuda_version >= 12000)
        replacement = (void *)cuGetProcAddress_v2;
    if (replacement != NULL)
        *function = replacement;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **function, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    proc_address_v2_fn driver = (proc_address_v2_fn)next("cuGetProcAddress_v2");
    if (driver == NULL)
        return NOT_INITIALIZED;
    CUresult result = driver(symbol, function, cuda_version, flags, status);
    if (result == SUCCESS)
        replace(symbol, function, cuda_version);
    return result;
}

CUresult cuGetProcAddress(const char *symbol, void **function, int cuda_version, cuuint64_t flags) {
    proc_address_fn driver = (proc_address_fn)next("cuGetProcAddress");
    if (driver == NULL)
        return NOT_INITIALIZED;
    CUresult result = driver(symbol, function, cuda_version, flags);
    if (result == SUCCESS)
        replace(symbol, function, cuda_version);
    return result;
}

void *dlsym(void *handle, const char *name) {
    dlsym_fn lookup = the_real_dlsym();
    void *found = lookup == NULL ? NULL : lookup(handle, name);
    void *replacement = hook(name);
    return found != NULL && replacement != NULL ? replacement : found; /* nothing where the handle has nothing */
}
