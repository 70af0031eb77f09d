"""The Container Device Interface (CDI) specs sharegpu's DRA kubelet plugin writes: what a container
that uses a claim of sharegpu's class gets, applied by a CDI-enabled runtime (containerd 1.7+,
CRI-O 1.23+).

One spec file per prepared claim, kind `KIND`, with one device per request of the claim. A device
carries the container edits of the hand-off (`api.handoff.values`): `NVIDIA_VISIBLE_DEVICES` naming
the GPUs' UUIDs and the limits the node enforces (HAMi-core's preload and limits, with the library's
directory mounted read-only; or MPS's pipe and limits, with the GPU's MPS tenant folder mounted read-only). The
GPU itself (device nodes, driver libraries) comes from the NVIDIA container toolkit's own CDI spec,
whose device for a UUID the plugin names beside sharegpu's (`nvidia_device`; the toolkit's spec is
generated with `nvidia-ctk cdi generate --device-name-strategy=uuid`).

Pure: no I/O. `agent.draplugin` writes and removes the files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from sharegpu.api import handoff, names
from sharegpu.core import allocation, errors

VERSION: Final = "0.6.0"
VENDOR: Final = "sharegpu.io"
CLASS: Final = "claim"
KIND: Final = f"{VENDOR}/{CLASS}"
NVIDIA_KIND: Final = "nvidia.com/gpu"
_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclass(frozen=True, slots=True)
class RequestDevices:
    """One request of a prepared claim: its name and the grants it holds (GPU index -> UUID known)."""

    request: str
    grants: tuple[allocation.DeviceGrant, ...]


def file_name(claim_uid: str) -> str:
    """The spec file of a claim (in the CDI directory): named by its UID."""
    return f"{VENDOR}-{CLASS}_{_safe(claim_uid)}.json"


def device_name(claim_uid: str, request: str) -> str:
    return _safe(f"{claim_uid}-{request}")


def device_id(claim_uid: str, request: str) -> str:
    """The fully qualified CDI device of a claim's request, as the runtime is told it."""
    return f"{KIND}={device_name(claim_uid, request)}"


def nvidia_device(uuid: str) -> str:
    """The NVIDIA container toolkit's CDI device of one GPU."""
    return f"{NVIDIA_KIND}={uuid}"


def _safe(text: str) -> str:
    return _NAME.sub("_", text)


@dataclass(frozen=True, slots=True)
class HostPaths:
    """Where on its node the agent keeps what a claim's containers mount: HAMI-core's library folder
    (its `--hami-core-dir`) and its MPS daemons' folders (its `--mps-root`)."""

    hami_core: str = handoff.HAMI_HOST_DIR
    mps_root: str = handoff.MPS_HOST_ROOT


AGENT_DEFAULTS: Final = HostPaths()
"""The agent's folders as it keeps them unless told otherwise."""


def edits(
    grants: Sequence[allocation.DeviceGrant],
    uuid_of: dict[int, str],
    enforce: handoff.Enforcement,
    host: HostPaths = AGENT_DEFAULTS,
) -> dict[str, Any]:
    """The container edits for a request's grants: the hand-off's variables as literal values (a
    CDI edit cannot refer to another variable), the preload and the mounts its limits need (from the
    agent's folders, `host`)."""
    if not grants:
        raise errors.InvalidInputError("a CDI device needs at least one GPU")
    values = handoff.values(grants, uuid_of, enforce)
    mounts: list[dict[str, Any]] = []
    if enforce.hami_core:
        values[handoff.LD_PRELOAD] = handoff.HAMI_LIBRARY
        mounts.append(_bind(host.hami_core, handoff.HAMI_MOUNT, read_only=True))
    if enforce.mps and len(grants) == 1:
        values[handoff.MPS_PIPE] = handoff.MPS_CLIENT_PIPE
        tenant = handoff.mps_tenant_folder(uuid_of[grants[0].index], host.mps_root)
        mounts.append(_bind(tenant, handoff.MPS_MOUNT, read_only=True))
    out: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(values.items()) if v != ""]}
    if mounts:
        out["mounts"] = mounts
    return out


def enforcement_of(body: Mapping[str, Any]) -> handoff.Enforcement:
    """The limits a spec (`spec`) was written with, read back from its devices' edits."""
    env = [
        str(line)
        for device in body.get("devices") or []
        if isinstance(device, dict)
        for line in (device.get("containerEdits") or {}).get("env") or []
    ]
    return handoff.Enforcement(
        hami_core=f"{handoff.LD_PRELOAD}={handoff.HAMI_LIBRARY}" in env,
        mps=any(line.startswith(f"{handoff.MPS_PIPE}=") for line in env),
    )


def _bind(host: str, container: str, *, read_only: bool) -> dict[str, Any]:
    options = ["rbind", "nosuid", "nodev", "ro" if read_only else "rw"]
    return {"hostPath": host, "containerPath": container, "options": options}


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A claim prepared on a node, as its CDI spec records it (the `names.CDI_CLAIM` annotation, read
    back by `of_spec` after an agent restart): which claim, and the memory it holds on each GPU. The
    node agent's watchdog judges the pods that use it by this."""

    namespace: str
    name: str
    uid: str
    gpus: dict[str, Annotated[int, msgspec.Meta(gt=0)] | None]
    """GPU UUID -> MiB the claim holds there (None: no memory limit)."""
    milli: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}
    """GPU UUID -> milli-GPU of compute the claim holds there (empty in specs written before it was
    recorded)."""

    @classmethod
    def of(
        cls, namespace: str, name: str, uid: str, requests: Sequence[RequestDevices], uuid_of: Mapping[int, str]
    ) -> PreparedClaim:
        """What a claim's requests hold per GPU: summed over them; no limit where a grant has none."""
        held: dict[str, int | None] = {}
        milli: dict[str, int] = {}
        for request in requests:
            for grant in request.grants:
                uuid = uuid_of[grant.index]
                held[uuid] = summed(held.get(uuid, 0), grant.memory_mib or None)
                milli[uuid] = milli.get(uuid, 0) + grant.milli
        return cls(
            namespace=namespace, name=name, uid=uid, gpus=dict(sorted(held.items())), milli=dict(sorted(milli.items()))
        )

    def annotations(self) -> dict[str, str]:
        return {names.CDI_CLAIM: msgspec.json.encode(self).decode()}

    @classmethod
    def of_spec(cls, body: Mapping[str, Any]) -> PreparedClaim | None:
        """The claim a spec (`spec`) was written for; None for one that does not say (written by an
        agent before the annotation) or says it in a shape this one cannot read."""
        text = (body.get("annotations") or {}).get(names.CDI_CLAIM)
        if not isinstance(text, str):
            return None
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError:  # a ValidationError too
            return None


def summed(before: int | None, mib: int | None) -> int | None:
    """Memory held together, in MiB: the sum, or None (no limit) once any part has none."""
    return None if before is None or mib is None else before + mib


def spec(
    claim_uid: str,
    requests: Sequence[RequestDevices],
    uuid_of: dict[int, str],
    enforce: handoff.Enforcement,
    prepared: PreparedClaim | None = None,
    host: HostPaths = AGENT_DEFAULTS,
) -> dict[str, Any]:
    """The CDI spec of one prepared claim (`prepared`: recorded in its annotations; `host`: the
    agent's folders its mounts come from)."""
    out: dict[str, Any] = {"cdiVersion": VERSION, "kind": KIND}
    if prepared is not None:
        out["annotations"] = prepared.annotations()
    return {
        **out,
        "devices": [
            {"name": device_name(claim_uid, r.request), "containerEdits": edits(r.grants, uuid_of, enforce, host)}
            for r in requests
        ],
    }
