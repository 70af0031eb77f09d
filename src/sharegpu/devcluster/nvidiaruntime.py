"""A fake NVIDIA container runtime for test nodes with a real runtime: an OCI runtime in front of runc
that gives a container the node's GPUs the way nvidia-container-runtime does, from the container's
own request. Run as containerd's runc binary (`containerd.Containerd` with a node's fake GPUs):

    python -m sharegpu.devcluster.nvidiaruntime --runc RUNC --nvml FILE --devices DIR -- RUNC-ARGS...

On `create` it reads the bundle's config.json; when the process's environment names GPUs
(NVIDIA_VISIBLE_DEVICES other than void or none), it adds what the real runtime's hook would: the
GPUs' device nodes (from DIR, made by `fakecri.fake_device_nodes`: all of them for `all`, else those
of the indices or UUIDs named) and, in place of the driver's NVML library, the node's fake NVML file
mounted read-only with SHAREGPU_FAKE_NVML naming it (sharegpu's agent reads it as --fake-nvml).
Then, for every command, it becomes runc. Only the standard library: it runs for every runc call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

NVML_MOUNT = "/run/nvidia/fake-nvml.yaml"
"""Where a GPU container finds the node's fake NVML file (SHAREGPU_FAKE_NVML names it)."""
NONE = ("", "void", "none")


def requested(env: list[str]) -> str:
    """The container's NVIDIA_VISIBLE_DEVICES ('' when it names no GPU)."""
    value = next((e.split("=", 1)[1] for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")), "")
    return "" if value.strip().lower() in NONE else value.strip()


def uuids(nvml: Path) -> list[str]:
    """The GPUs' UUIDs in the fake NVML file, in index order (its `uuid:` entries, read as text)."""
    return re.findall(r"uuid:\s*([^,}\s]+)", nvml.read_text()) if nvml.is_file() else []


def devices(folder: Path, value: str, nvml: Path) -> list[Path]:
    """The device nodes a request gives: every GPU's for `all`, else those of the GPUs named (by index
    or UUID, as the device plugin names them), and the control nodes."""
    gpus = sorted((p for p in folder.glob("nvidia[0-9]*")), key=lambda p: int(p.name.removeprefix("nvidia")))
    if value != "all":
        index = {u: str(i) for i, u in enumerate(uuids(nvml))}
        named = {index.get(part.strip(), part.strip()) for part in value.split(",")}
        gpus = [p for p in gpus if p.name.removeprefix("nvidia") in named]
    return gpus + [p for p in (folder / "nvidiactl", folder / "nvidia-uvm") if p.exists()]


def edit(config: dict[str, Any], nvml: Path, folder: Path) -> bool:
    """Give the process the GPUs its environment asks for; False when it asks for none."""
    process = config.setdefault("process", {})
    env: list[str] = process.setdefault("env", [])
    value = requested(env)
    if not value:
        return False
    mounts = config.setdefault("mounts", [])
    mounts.append({"destination": NVML_MOUNT, "type": "bind", "source": str(nvml), "options": ["rbind", "ro"]})
    env.append(f"SHAREGPU_FAKE_NVML={NVML_MOUNT}")
    linux = config.setdefault("linux", {})
    for node in devices(folder, value, nvml):
        info = node.stat()
        major, minor = os.major(info.st_rdev), os.minor(info.st_rdev)
        linux.setdefault("devices", []).append(
            {"path": f"/dev/{node.name}", "type": "c" if stat.S_ISCHR(info.st_mode) else "b",
             "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}
        )  # fmt: skip
        rules = linux.setdefault("resources", {}).setdefault("devices", [])
        rules.append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
    return True


def bundle_of(args: list[str]) -> Path | None:
    """The bundle of a `create` (or `run`) command among runc's arguments."""
    if not any(a in ("create", "run") for a in args):
        return None
    for i, arg in enumerate(args):
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--bundle="):
            return Path(arg.split("=", 1)[1])
    return Path.cwd()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nvidiaruntime", description=__doc__.splitlines()[0])
    parser.add_argument("--runc", required=True)
    parser.add_argument("--nvml", type=Path, required=True)
    parser.add_argument("--devices", type=Path, required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    rest = options.rest[1:] if options.rest[:1] == ["--"] else options.rest
    bundle = bundle_of(rest)
    if bundle is not None and (bundle / "config.json").is_file():
        path = bundle / "config.json"
        config = json.loads(path.read_text())
        if edit(config, options.nvml, options.devices):
            path.write_text(json.dumps(config))
    os.execv(options.runc, [options.runc, *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
