"""The GPU workload of `sharegpu gpu-check`: a child process that burns compute, or holds memory.

`python -m sharegpu.agent.cuda.burn --seconds S [--libcuda PATH] [--wait]` loads `PTX`, a small
hand-written kernel of dependent FMA chains, through the driver's libcuda (ctypes, `cuModuleLoadData`:
the driver compiles PTX itself, so no CUDA toolkit is needed), and launches it over and over for S
seconds, `BLOCKS` blocks each (every SM of any current GPU busy many times over), waiting for each to
finish. It prints one JSON object, `{"launches", "seconds", "rate", "sms"}`: the rate is launches per
second over the second half of the run (set-up and ramp-up left out), `sms` the multiprocessor count
the driver told it (a client that MPS limits may be told fewer). With `--wait` it first prints
`{"ready": true, "sms": N}` once the kernel is loaded and has run once, and starts only when a line
arrives on stdin, so that several children can start together.

`--hold-mib N` instead allocates N MiB on device 0, prints `{"held_mib": N}` and sleeps until it is
killed (for a check that NVML lists the process with its memory).

It runs on device 0 of whatever CUDA_VISIBLE_DEVICES shows it, in whatever environment it is given
(an MPS client's, or one that preloads HAMi-core), so it imports nothing but the standard library and
`cuda.child`, whose `Driver` makes its driver calls (through dlsym, as ctypes looks names up). A failed
driver call prints one line on stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from sharegpu.agent.cuda import child as cudachild

MIB: Final = 1 << 20
ITERATIONS: Final = 4096
"""Loop trips per thread; each trip is one FMA on each of 4 independent chains."""
THREADS: Final = 256
"""Threads per block."""
BLOCKS: Final = 16384
"""Blocks per launch: over a hundred per SM of a 132-SM H200, where one SM runs 8 at a time. The same
for every run, so that rates compare: a grid sized from the SM count the driver reports would shrink
with the limit under test (MPS may report only the SMs it provisions) and hide it."""
MULTIPROCESSOR_COUNT: Final = 16
"""CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT."""
KERNEL: Final = "burn"


def _f32(value: float) -> str:
    """A float as PTX writes an exact single-precision constant (0f + its 8 hex digits)."""
    return "0f" + struct.pack(">f", value).hex().upper()


PTX: Final = f"""\
.version 7.0
.target sm_70
.address_size 64

.visible .entry {KERNEL}(
    .param .u64 out,
    .param .u32 iterations
)
{{
    .reg .pred %p<2>;
    .reg .b32 %r<7>;
    .reg .f32 %f<10>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [iterations];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    cvt.rn.f32.u32 %f1, %r5;
    mul.f32 %f1, %f1, {_f32(2.0**-24)};
    add.f32 %f2, %f1, {_f32(1.0)};
    add.f32 %f3, %f1, {_f32(2.0)};
    add.f32 %f4, %f1, {_f32(3.0)};
    add.f32 %f5, %f1, {_f32(4.0)};
    mov.f32 %f6, {_f32(0.99998)};
    mov.f32 %f7, {_f32(1e-4)};
    mov.u32 %r6, 0;
$L_loop:
    fma.rn.f32 %f2, %f2, %f6, %f7;
    fma.rn.f32 %f3, %f3, %f6, %f7;
    fma.rn.f32 %f4, %f4, %f6, %f7;
    fma.rn.f32 %f5, %f5, %f6, %f7;
    add.s32 %r6, %r6, 1;
    setp.lt.u32 %p1, %r6, %r1;
    @%p1 bra $L_loop;
    add.f32 %f8, %f2, %f3;
    add.f32 %f9, %f4, %f5;
    add.f32 %f8, %f8, %f9;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.f32 [%rd4], %f8;
    ret;
}}
"""
"""Per thread: four chains x <- x * 0.99998 + 1e-4 (each FMA waits for the one before; the values stay
finite), their sum stored at the thread's index so that nothing is optimised away."""

_VOID_P: Final = ctypes.c_void_p
_PROTOTYPES: Final[dict[str, tuple[Any, ...]]] = {
    **cudachild.PROTOTYPES,
    "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuModuleLoadData": (ctypes.POINTER(_VOID_P), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_VOID_P), _VOID_P, ctypes.c_char_p),
    # function, grid x y z, block x y z, shared memory bytes, stream, kernel parameters, extra
    "cuLaunchKernel": (_VOID_P, *[ctypes.c_uint] * 7, _VOID_P, ctypes.POINTER(_VOID_P), ctypes.POINTER(_VOID_P)),
    "cuCtxSynchronize": (),
}
"""The parameters of each driver call used: cudachild's, and the kernel's (each returns a CUresult, an int)."""


def _driver(libcuda: str) -> cudachild.Driver:
    """The driver behind `libcuda`, its calls looked up by dlsym; raises cudachild.DriverError."""
    return cudachild.Driver(cudachild.DLSYM, cudachild.by_dlsym(cudachild.load(libcuda)), _PROTOTYPES)


def driver_version(libcuda: str = "libcuda.so.1") -> int:
    """The CUDA version of the driver behind `libcuda` (cuDriverGetVersion; needs no cuInit)."""
    return _driver(libcuda).version()


def version_text(version: int) -> str:
    """12080 -> "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def rate(started: float, finished: Sequence[float]) -> float:
    """Launches per second over the second half of a run that began at `started` and completed a
    launch at each of `finished` (ascending): those completed after the midpoint, over the time from
    the last completion at or before it (or the start) to the last one."""
    if not finished:
        return 0.0
    middle = started + (finished[-1] - started) / 2
    before = [t for t in finished if t <= middle]
    after = len(finished) - len(before)
    origin = before[-1] if before else started
    span = finished[-1] - origin
    return after / span if span > 0 and after else 0.0


class Burner:
    """The kernel loaded on device 0, with an output buffer for every thread of one launch."""

    def __init__(self, driver: cudachild.Driver, iterations: int = ITERATIONS) -> None:
        self.driver = driver
        device = driver.device_zero()
        sms = ctypes.c_int(0)
        driver.call("cuDeviceGetAttribute", ctypes.byref(sms), MULTIPROCESSOR_COUNT, device)
        self.sms = sms.value
        self.blocks = BLOCKS
        module = _VOID_P()
        driver.call("cuModuleLoadData", ctypes.byref(module), PTX.encode() + b"\0")
        self.function = _VOID_P()
        driver.call("cuModuleGetFunction", ctypes.byref(self.function), module, KERNEL.encode())
        self.out = ctypes.c_uint64(driver.allocate(self.blocks * THREADS * 4))
        self.iterations = ctypes.c_uint32(iterations)
        arguments = (_VOID_P * 2)(ctypes.addressof(self.out), ctypes.addressof(self.iterations))
        self.arguments = arguments

    def launch(self) -> None:
        """One launch, waited for."""
        self.driver.call(
            "cuLaunchKernel", self.function, self.blocks, 1, 1, THREADS, 1, 1, 0, None,
            ctypes.cast(self.arguments, ctypes.POINTER(_VOID_P)), None,
        )  # fmt: skip
        self.driver.call("cuCtxSynchronize")

    def run(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
        """Launch for `seconds`; the result the child prints."""
        started = clock()
        finished: list[float] = []
        while not finished or finished[-1] - started < seconds:
            self.launch()
            finished.append(clock())
        seconds_run = finished[-1] - started
        return {"launches": len(finished), "seconds": seconds_run, "rate": rate(started, finished), "sms": self.sms}


def _print(value: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def _burn(libcuda: str, seconds: float, wait: bool) -> int:
    burner = Burner(_driver(libcuda))
    burner.launch()  # the first launch pays for loading; the run measures the steady state
    if wait:
        _print({"ready": True, "sms": burner.sms})
        if not sys.stdin.readline():
            return 0  # the parent went away before the start
    _print(burner.run(seconds))
    return 0


def _hold(libcuda: str, mib: int) -> int:
    driver = _driver(libcuda)
    driver.device_zero()
    driver.allocate(mib * MIB)
    _print({"held_mib": mib})
    while True:
        signal.pause()


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not positive")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharegpu.agent.cuda.burn",
        description="Launch an FMA kernel for some seconds and print the launch rate; or hold GPU memory.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--seconds", type=_positive(float), help="how long to launch")
    what.add_argument("--hold-mib", type=_positive(int), help="instead, hold this many MiB until killed")
    parser.add_argument("--libcuda", default="libcuda.so.1", help="the driver's library (a path or a soname)")
    parser.add_argument("--wait", action="store_true", help="print a ready line, then start on a line from stdin")
    arguments = parser.parse_args(argv)
    try:
        if arguments.hold_mib is not None:
            return _hold(arguments.libcuda, int(arguments.hold_mib))
        return _burn(arguments.libcuda, float(arguments.seconds), arguments.wait)
    except cudachild.DriverError as error:
        sys.stderr.write(f"cudaburn: {error}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
