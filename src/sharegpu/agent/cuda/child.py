"""The CUDA probe's child process: ask the driver's libcuda, through ctypes, whether a memory limit binds.

`cudaprobe.run` starts it as `python -m sharegpu.agent.cuda.child --libcuda PATH --limit-mib N
[--attempts K]` in the environment of the isolation mode under test, which may preload a foreign
library (HAMi-core) or point the driver at an MPS daemon. It therefore imports only the standard
library and `sharegpu.core.errors`, and needs no CUDA toolkit: libcuda is the driver's own library.

It reaches the driver's functions through each way a CUDA program does, since an isolation library
must intercept them all to bind:

- `dlsym`: the versioned names (cuMemAlloc_v2) looked up on libcuda's handle, as ctypes does and the
  CUDA runtime did before 12.0 (HAMi-core hooks this by overriding dlsym);
- `getprocaddress`: base names (cuMemAlloc) resolved by cuGetProcAddress_v2 (or cuGetProcAddress,
  where libcuda has no _v2) for CUDA 12.0, as the CUDA 12 runtime and PyTorch do. A libcuda that has
  neither is reported in "unavailable", not as a failure.

Through each: cuInit, device 0's primary context made current, cuMemGetInfo, one allocation of half the
limit (which must succeed), then `attempts` allocations of twice the limit (each success freed and
counted). It prints one JSON object on stdout, `{"results": [...], "unavailable": [...]}`, a result
per lookup that ran: lookup, total_mib, free_mib, below_ok, attempts, above_succeeded and error ("" or
what failed, e.g. "cuInit returned 100"), and exits 0; the parent judges. Only bad arguments exit
otherwise (argparse's status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from sharegpu.core import errors

MIB: Final = 1 << 20
CUDA_VERSION: Final = 12000
"""The CUDA version cuGetProcAddress resolves for: 12.0, whose variants of these calls are the _v2 ones."""
DEFAULT_FLAGS: Final = 0
"""CU_GET_PROC_ADDRESS_DEFAULT."""
DLSYM: Final = "dlsym"
GETPROCADDRESS: Final = "getprocaddress"

PROTOTYPES: Final[Mapping[str, tuple[Any, ...]]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDriverGetVersion": (ctypes.POINTER(ctypes.c_int),),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
    "cuCtxSetCurrent": (ctypes.c_void_p,),
    "cuMemGetInfo": (ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)),
    "cuMemAlloc": (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t),
    "cuMemFree": (ctypes.c_uint64,),
    "cuDevicePrimaryCtxRelease": (ctypes.c_int,),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
"""Each call's parameters by base name (each returns a CUresult, an int): those `Driver` itself makes.
A caller that makes others passes a table that adds them."""

_EXPORTED: Final[dict[str, tuple[str, ...]]] = {
    "cuMemGetInfo": ("cuMemGetInfo_v2",),
    "cuMemAlloc": ("cuMemAlloc_v2",),
    "cuMemFree": ("cuMemFree_v2",),
    "cuDevicePrimaryCtxRelease": ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
}
"""The names dlsym looks for, first found wins, where they differ from the base name."""


class DriverError(errors.SharegpuError):
    """A driver call returned non-zero, or a function could not be found (the message says which)."""


Resolve = Callable[[str], tuple[str, int]]
"""Base name -> (the name found, its address); raises DriverError."""


def load(libcuda: str) -> ctypes.CDLL:
    """The driver's library, its symbols resolved now and visible to libraries loaded after it."""
    try:
        return ctypes.CDLL(libcuda, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as error:
        raise DriverError(f"cannot load {libcuda}: {error}") from None


def by_dlsym(library: ctypes.CDLL) -> Resolve:
    """Resolution by name on libcuda's handle (ctypes calls dlsym, so an override of dlsym sees it)."""

    def resolve(base: str) -> tuple[str, int]:
        for name in _EXPORTED.get(base, (base,)):
            try:
                function = library[name]
            except AttributeError:
                continue
            address = ctypes.cast(function, ctypes.c_void_p).value
            if address:
                return name, address
        raise DriverError(f"libcuda has no {' or '.join(_EXPORTED.get(base, (base,)))}")

    return resolve


def by_proc_address(library: ctypes.CDLL) -> Resolve | None:
    """Resolution through cuGetProcAddress_v2 (or cuGetProcAddress); None when libcuda has neither."""
    for name in ("cuGetProcAddress_v2", "cuGetProcAddress"):
        try:
            lookup = library[name]
        except AttributeError:
            continue
        return _proc_address(lookup, name)
    return None


def _proc_address(lookup: Any, name: str) -> Resolve:
    v2 = name.endswith("_v2")
    lookup.restype = ctypes.c_int
    lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64] + (
        [ctypes.POINTER(ctypes.c_int)] if v2 else []
    )

    def resolve(base: str) -> tuple[str, int]:
        address = ctypes.c_void_p()
        status = ctypes.c_int(0)
        arguments: list[Any] = [base.encode(), ctypes.byref(address), CUDA_VERSION, DEFAULT_FLAGS]
        if v2:
            arguments.append(ctypes.byref(status))
        code = lookup(*arguments)
        if code != 0:
            raise DriverError(f"{name}({base}) returned {code}")
        if not address.value:
            raise DriverError(f"{name}({base}) found nothing (status {status.value})")
        return base, address.value

    return resolve


class Driver:
    """The driver's calls as one lookup found them, with the parameters `prototypes` gives each base
    name; `call` raises DriverError on a non-zero CUresult."""

    def __init__(self, lookup: str, resolve: Resolve, prototypes: Mapping[str, tuple[Any, ...]] = PROTOTYPES) -> None:
        self.lookup = lookup
        self._resolve = resolve
        self._prototypes = prototypes
        self._functions: dict[str, tuple[str, Callable[..., int]]] = {}

    def _function(self, base: str) -> tuple[str, Callable[..., int]]:
        if base not in self._functions:
            name, address = self._resolve(base)
            prototype = ctypes.CFUNCTYPE(ctypes.c_int, *self._prototypes[base])
            self._functions[base] = name, prototype(address)
        return self._functions[base]

    def status(self, base: str, *arguments: Any) -> int:
        """The CUresult of one call."""
        _name, function = self._function(base)
        return int(function(*arguments))

    def call(self, base: str, *arguments: Any) -> None:
        """One call; a non-zero CUresult raises DriverError, with cuGetErrorString's text where it has one."""
        name, function = self._function(base)
        code = int(function(*arguments))
        if code != 0:
            raise DriverError(f"{name} returned {code}{self._describe(code)}")

    def _describe(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            if self.status("cuGetErrorString", code, ctypes.byref(text)) == 0 and text.value:
                return f" ({text.value.decode(errors='replace')})"
        except DriverError:
            pass
        return ""

    def version(self) -> int:
        """cuDriverGetVersion: the CUDA version the driver supports, e.g. 12080 for 12.8 (needs no cuInit)."""
        value = ctypes.c_int(0)
        self.call("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    def device_zero(self) -> int:
        """cuInit, then device 0's primary context retained and made current; returns the device. A
        context that cannot be made current is released again before the error is raised."""
        self.call("cuInit", 0)
        device = ctypes.c_int(0)
        self.call("cuDeviceGet", ctypes.byref(device), 0)
        context = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        try:
            self.call("cuCtxSetCurrent", context)
        except DriverError:
            with contextlib.suppress(DriverError):
                self.call("cuDevicePrimaryCtxRelease", device)
            raise
        return device.value

    def allocate(self, size: int) -> int:
        """cuMemAlloc of `size` bytes; the device pointer."""
        pointer = ctypes.c_uint64(0)
        self.call("cuMemAlloc", ctypes.byref(pointer), size)
        return pointer.value

    def allocates(self, mib: int) -> bool:
        """Whether an allocation of `mib` MiB succeeds (it is freed at once)."""
        pointer = ctypes.c_uint64(0)
        if self.status("cuMemAlloc", ctypes.byref(pointer), mib * MIB) != 0:
            return False
        self.call("cuMemFree", pointer)
        return True


def check(driver: Driver, limit_mib: int, attempts: int) -> dict[str, Any]:
    """What device 0 looks like through `driver`, and which allocations it allows around the limit."""
    result: dict[str, Any] = {
        "lookup": driver.lookup,
        "total_mib": 0,
        "free_mib": 0,
        "below_ok": False,
        "attempts": attempts,
        "above_succeeded": 0,
        "error": "",
    }
    try:
        device = driver.device_zero()
        failure: DriverError | None = None
        try:
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            driver.call("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
            result["total_mib"] = total.value // MIB
            result["free_mib"] = free.value // MIB
            result["below_ok"] = driver.allocates(limit_mib // 2)
            result["above_succeeded"] = sum(driver.allocates(2 * limit_mib) for _ in range(attempts))
        except DriverError as error:
            failure = error
        try:
            driver.call("cuDevicePrimaryCtxRelease", device)
        except DriverError as error:
            failure = failure or error
        if failure is not None:
            raise failure
    except DriverError as error:
        result["error"] = str(error)
    return result


def probe(libcuda: str, limit_mib: int, attempts: int) -> dict[str, Any]:
    """The JSON object the child prints."""
    try:
        library = load(libcuda)
    except DriverError as error:
        failed = check(Driver(DLSYM, _failing(error)), limit_mib, attempts)
        return {"results": [failed], "unavailable": []}
    results = [check(Driver(DLSYM, by_dlsym(library)), limit_mib, attempts)]
    unavailable = []
    resolve = by_proc_address(library)
    if resolve is None:
        unavailable.append(GETPROCADDRESS)
    else:
        results.append(check(Driver(GETPROCADDRESS, resolve), limit_mib, attempts))
    return {"results": results, "unavailable": unavailable}


def _failing(error: DriverError) -> Resolve:
    """A resolution that finds nothing, raising `error` (why there is no library to look in)."""

    def resolve(base: str) -> tuple[str, int]:
        raise error

    return resolve


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharegpu.agent.cuda.child",
        description="Check through libcuda that a GPU memory limit binds; prints one JSON object.",
    )
    parser.add_argument("--libcuda", required=True, help="the driver's library (a path or a soname)")
    parser.add_argument("--limit-mib", required=True, type=_at_least(2), help="the limit expected, in MiB")
    parser.add_argument("--attempts", type=_at_least(1), default=3, help="allocations tried above the limit")
    arguments = parser.parse_args(argv)
    report = probe(arguments.libcuda, arguments.limit_mib, arguments.attempts)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
