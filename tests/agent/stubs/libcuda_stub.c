/* A stand-in for the NVIDIA driver's libcuda, for tests of the CUDA probe on machines without a GPU.
 *
 * It exports the few driver calls the probe makes, keeps count of the bytes "allocated" (the pointers
 * are made up; no memory is taken) and refuses an allocation past the device's total with
 * CUDA_ERROR_OUT_OF_MEMORY (2). Single-threaded on purpose: the probe calls it from one thread.
 *
 * Environment, read at cuInit:
 *   STUB_CUDA_TOTAL_MIB      the device's memory in MiB (default 81920, an H100's);
 *   STUB_CUDA_INIT_ERROR     cuInit returns this number (e.g. 100, CUDA_ERROR_NO_DEVICE);
 *   STUB_CUDA_INIT_SLEEP_MS  cuInit first sleeps this long (a driver that hangs);
 *   CUDA_MPS_PIPE_DIRECTORY  MPS: when <dir>/control is a FIFO that a daemon reads (it opens for writing
 *                            without blocking), the stub writes "client <pid>\n" to it and from then on
 *                            applies CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=64M,1=2G": device 0's entry;
 *                            suffix K, M or G, none meaning bytes): cuMemGetInfo reports at most the limit
 *                            less what is allocated as free (the total stays the device's) and
 *                            allocations past it fail. No reader, or no FIFO, means no daemon: like the
 *                            real driver, the stub then runs without MPS.
 *
 * cuGetProcAddress(_v2) resolves base names ("cuMemAlloc") to the variant of the asked CUDA version, as
 * the real driver does, through a table of the stub's internal functions: a preloaded library that
 * exports the same names therefore does not change what it returns (the real driver is not interposed
 * on either), only a hook on cuGetProcAddress does.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef int CUdriverProcAddressQueryResult;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    NOT_FOUND = 500,
};
enum { SYMBOL_FOUND = 0, SYMBOL_NOT_FOUND = 1 };

#define MIB (1024ULL * 1024ULL)
#define SLOTS 256

static int initialized;
static unsigned long long total_bytes;
static unsigned long long used_bytes;
static int mps;
static unsigned long long mps_limit_bytes;
static int context_refs;
static int context_token;
static CUdeviceptr next_pointer = 0x7f0000000000ULL;
static struct {
    CUdeviceptr pointer;
    unsigned long long bytes;
} slots[SLOTS];

static unsigned long long env_number(const char *name, unsigned long long fallback) {
    const char *text = getenv(name);
    if (text == NULL || *text == '\0')
        return fallback;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    return *end == '\0' ? value : fallback;
}

/* "0=64M,1=2G": the bytes of device 0's entry; 0 when it has none or cannot be read. */
static unsigned long long device0_limit(const char *text) {
    while (text != NULL && *text != '\0') {
        char *end = NULL;
        unsigned long index = strtoul(text, &end, 10);
        if (end != text && *end == '=') {
            const char *number = end + 1;
            unsigned long long value = strtoull(number, &end, 10);
            unsigned long long unit = 1;
            switch (*end) {
            case 'K': case 'k': unit = 1024ULL; end++; break;
            case 'M': case 'm': unit = MIB; end++; break;
            case 'G': case 'g': unit = 1024ULL * MIB; end++; break;
            default: break;
            }
            if (end != number && (*end == ',' || *end == '\0') && index == 0)
                return value * unit;
        }
        text = strchr(text, ',');
        if (text != NULL)
            text++;
    }
    return 0;
}

/* Whether an MPS daemon listens on <CUDA_MPS_PIPE_DIRECTORY>/control; if so, announce this client. */
static int join_mps(void) {
    const char *directory = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (directory == NULL || *directory == '\0')
        return 0;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/control", directory) >= (int)sizeof path)
        return 0;
    int fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return 0; /* ENXIO: a FIFO nobody reads; ENOENT: no daemon ever started */
    struct stat info;
    if (fstat(fd, &info) != 0 || !S_ISFIFO(info.st_mode)) {
        close(fd);
        return 0;
    }
    char line[64];
    int length = snprintf(line, sizeof line, "client %d\n", (int)getpid());
    ssize_t written = write(fd, line, (size_t)length);
    close(fd);
    return written == length;
}

static CUresult init(unsigned int flags) {
    (void)flags;
    unsigned long long sleep_ms = env_number("STUB_CUDA_INIT_SLEEP_MS", 0);
    if (sleep_ms > 0) {
        struct timespec pause = {(time_t)(sleep_ms / 1000), (long)(sleep_ms % 1000) * 1000000L};
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
    }
    unsigned long long error = env_number("STUB_CUDA_INIT_ERROR", 0);
    if (error != 0)
        return (CUresult)error;
    if (!initialized) {
        total_bytes = env_number("STUB_CUDA_TOTAL_MIB", 81920) * MIB;
        if (join_mps()) {
            mps = 1;
            mps_limit_bytes = device0_limit(getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        }
        initialized = 1;
    }
    return SUCCESS;
}

static CUresult driver_version(int *version) {
    if (version == NULL)
        return INVALID_VALUE;
    *version = 12080;
    return SUCCESS;
}

static CUresult device_get(CUdevice *device, int ordinal) {
    if (!initialized)
        return NOT_INITIALIZED;
    if (device == NULL)
        return INVALID_VALUE;
    if (ordinal != 0)
        return INVALID_DEVICE;
    *device = 0;
    return SUCCESS;
}

static CUresult context_retain(CUcontext *context, CUdevice device) {
    if (!initialized)
        return NOT_INITIALIZED;
    if (context == NULL)
        return INVALID_VALUE;
    if (device != 0)
        return INVALID_DEVICE;
    context_refs++;
    *context = &context_token;
    return SUCCESS;
}

static CUresult context_release(CUdevice device) {
    if (!initialized)
        return NOT_INITIALIZED;
    if (device != 0)
        return INVALID_DEVICE;
    if (context_refs == 0)
        return INVALID_CONTEXT;
    context_refs--;
    return SUCCESS;
}

static CUresult context_set_current(CUcontext context) {
    if (!initialized)
        return NOT_INITIALIZED;
    return context == NULL || context == &context_token ? SUCCESS : INVALID_CONTEXT;
}

static unsigned long long room(void) {
    unsigned long long free_bytes = total_bytes - used_bytes;
    if (mps) {
        unsigned long long left = mps_limit_bytes > used_bytes ? mps_limit_bytes - used_bytes : 0;
        if (left < free_bytes)
            free_bytes = left;
    }
    return free_bytes;
}

static CUresult memory_info(size_t *free_bytes, size_t *total) {
    if (!initialized)
        return NOT_INITIALIZED;
    if (free_bytes == NULL || total == NULL)
        return INVALID_VALUE;
    *free_bytes = (size_t)room();
    *total = (size_t)total_bytes;
    return SUCCESS;
}

static CUresult memory_allocate(CUdeviceptr *pointer, size_t bytes) {
    if (!initialized)
        return NOT_INITIALIZED;
    if (pointer == NULL || bytes == 0)
        return INVALID_VALUE;
    if (bytes > room())
        return OUT_OF_MEMORY;
    for (int i = 0; i < SLOTS; i++) {
        if (slots[i].pointer == 0) {
            slots[i].pointer = next_pointer;
            slots[i].bytes = bytes;
            next_pointer += (bytes + MIB - 1) / MIB * MIB;
            used_bytes += bytes;
            *pointer = slots[i].pointer;
            return SUCCESS;
        }
    }
    return OUT_OF_MEMORY;
}

static CUresult memory_free(CUdeviceptr pointer) {
    if (!initialized)
        return NOT_INITIALIZED;
    for (int i = 0; i < SLOTS; i++) {
        if (pointer != 0 && slots[i].pointer == pointer) {
            used_bytes -= slots[i].bytes;
            slots[i].pointer = 0;
            slots[i].bytes = 0;
            return SUCCESS;
        }
    }
    return INVALID_VALUE;
}

static CUresult proc_address_v2(const char *symbol, void **function, int cuda_version, cuuint64_t flags,
                                CUdriverProcAddressQueryResult *status);

static CUresult proc_address(const char *symbol, void **function, int cuda_version, cuuint64_t flags) {
    return proc_address_v2(symbol, function, cuda_version, flags, NULL);
}

/* Base name, the CUDA version from which `function` is the variant returned, and that variant. */
static const struct {
    const char *name;
    int since;
    void *function;
} table[] = {
    {"cuInit", 2000, (void *)init},
    {"cuDriverGetVersion", 2020, (void *)driver_version},
    {"cuDeviceGet", 2000, (void *)device_get},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)context_retain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)context_release}, /* _v2 */
    {"cuDevicePrimaryCtxRelease", 7000, (void *)context_release},
    {"cuCtxSetCurrent", 4000, (void *)context_set_current},
    {"cuMemGetInfo", 3020, (void *)memory_info}, /* _v2 */
    {"cuMemAlloc", 3020, (void *)memory_allocate}, /* _v2 */
    {"cuMemFree", 3020, (void *)memory_free}, /* _v2 */
    {"cuGetProcAddress", 12000, (void *)proc_address_v2}, /* _v2 */
    {"cuGetProcAddress", 11030, (void *)proc_address},
};

static CUresult proc_address_v2(const char *symbol, void **function, int cuda_version, cuuint64_t flags,
                                CUdriverProcAddressQueryResult *status) {
    (void)flags;
    if (symbol == NULL || function == NULL)
        return INVALID_VALUE;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) == 0 && cuda_version >= table[i].since) {
            *function = table[i].function;
            if (status != NULL)
                *status = SYMBOL_FOUND;
            return SUCCESS;
        }
    }
    *function = NULL;
    if (status != NULL)
        *status = SYMBOL_NOT_FOUND;
    return NOT_FOUND;
}

/* The exported names: thin entry points to the functions above. */

CUresult cuInit(unsigned int flags) { return init(flags); }
CUresult cuDriverGetVersion(int *version) { return driver_version(version); }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { return device_get(device, ordinal); }
CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) { return context_retain(context, device); }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) { return context_release(device); }
CUresult cuDevicePrimaryCtxRelease(CUdevice device) { return context_release(device); }
CUresult cuCtxSetCurrent(CUcontext context) { return context_set_current(context); }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) { return memory_info(free_bytes, total); }
CUresult cuMemAlloc_v2(CUdeviceptr *pointer, size_t bytes) { return memory_allocate(pointer, bytes); }
CUresult cuMemFree_v2(CUdeviceptr pointer) { return memory_free(pointer); }

#ifndef STUB_NO_PROC_ADDRESS /* defined: a driver older than CUDA 11.3, reached through dlsym alone */
CUresult cuGetProcAddress_v2(const char *symbol, void **function, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    return proc_address_v2(symbol, function, cuda_version, flags, status);
}

CUresult cuGetProcAddress(const char *symbol, void **function, int cuda_version, cuuint64_t flags) {
    return proc_address(symbol, function, cuda_version, flags);
}
#endif
