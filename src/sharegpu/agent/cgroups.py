"""Which pod and container a host process belongs to, from its `/proc/<pid>/cgroup`.

The usage watchdog gets pids from NVML and needs the pod (and container) behind each. The kubelet
puts every pod in a cgroup of its own and the runtime puts each container in one below it, so the
path in the process's cgroup file names both. The layouts known here:

- cgroup driver `systemd` (the pod UID with '_' for '-'; the runtime names the container scope):

      /kubepods.slice/kubepods-pod<uid>.slice/cri-containerd-<id>.scope              guaranteed
      /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/crio-<id>.scope
      /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice/docker-<id>.scope

  A `--cgroup-root` adds its name in front of every slice (kind's `/kubelet` gives
  `kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable-pod<uid>.slice/...`).
- cgroup driver `cgroupfs` (a bare container id, or CRI-O's `crio-<id>`):

      /kubepods/pod<uid>/<id>                                                          guaranteed
      /kubepods/burstable/pod<uid>/<id>
      /kubepods/besteffort/pod<uid>/crio-<id>

- The file itself: cgroup v1 (a line `id:controllers:path` per hierarchy), v2 (the one line
  `0::path`) or both at once (hybrid). The lines that name a pod must agree on it; if several name
  a container they must agree on that too, else nothing is reported.

The pod may sit anywhere in the path: after a cgroup-root prefix (`/system.slice/...`,
`/custom/kubepods/...`), or after `/..` segments when the agent runs in its own cgroup namespace
and the process lives outside it. A cgroupfs `pod<uid>` counts only under `kubepods` (or its QoS
class), or under `..` whose names the namespace hides. A pod above the agent's namespace root
cannot be seen at all, so processes of the agent's own pod may go unattributed there.

A process directly in the pod's cgroup (not in any container's) gets the pod with no container. The
pause (sandbox) container has a scope of its own like any container, so its id is the sandbox's,
which matches no `status.containerStatuses[].containerID` (`container_id` strips their scheme): the
caller counts such a process for the pod alone. Anything below a container's cgroup (sub-cgroups the
container made) is still that container. Anything else beside the containers under a pod (CRI-O's
`crio-conmon-<id>` monitor) and any process outside all pods (system services, the agent when it
has no namespace of its own) gives None; so do a process that has gone, a file the agent may not
read, and contents that are not a cgroup file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sharegpu.agent import host


@dataclass(frozen=True, slots=True)
class Owner:
    """The pod a process runs in (its UID, dashed) and its container's bare id (None: the pod's own)."""

    pod_uid: str
    container_id: str | None


def _uid(separator: str) -> str:
    """A pod UID: an RFC 4122 UUID with its dashes written as `separator`, or a static pod's 32-hex hash."""
    s = separator
    return f"[0-9a-f]{{8}}{s}[0-9a-f]{{4}}{s}[0-9a-f]{{4}}{s}[0-9a-f]{{4}}{s}[0-9a-f]{{12}}|[0-9a-f]{{32}}"


_LINE: Final = re.compile(r"\d+:[^:]*:(?P<path>.*)")
_SYSTEMD_POD: Final = re.compile(rf"(?:.+-)?kubepods(?:-burstable|-besteffort)?-pod(?P<uid>{_uid('_')})\.slice")
_SYSTEMD_CONTAINER: Final = re.compile(r"(?:cri-containerd|crio|docker)-(?P<id>[0-9a-f]{12,})\.scope")
_CGROUPFS_POD: Final = re.compile(rf"pod(?P<uid>{_uid('-')})")
_CGROUPFS_CONTAINER: Final = re.compile(r"(?:crio-)?(?P<id>[0-9a-f]{12,})")
_QOS: Final = frozenset({"burstable", "besteffort"})
_KUBEPODS_PARENTS: Final = frozenset({"kubepods", ".."})


def owner_of(text: str) -> Owner | None:
    """The pod and container named by the contents of a `/proc/<pid>/cgroup` file, or None."""
    owners: set[Owner] = set()
    for line in text.splitlines():
        parsed = _LINE.fullmatch(line)
        if parsed is None:
            return None
        owner = _owner_in(parsed["path"])
        if owner is not None:
            owners.add(owner)
    if len({owner.pod_uid for owner in owners}) != 1:
        return None
    in_containers = [owner for owner in owners if owner.container_id is not None]
    if len(in_containers) > 1:
        return None
    return in_containers[0] if in_containers else owners.pop()


def read_owner(pid: int, proc: Path = host.PROC) -> Owner | None:
    """The owner of process `pid` from `<proc>/<pid>/cgroup`; None if it has gone or cannot be read."""
    try:
        text = (proc / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:  # gone (ENOENT, ESRCH mid-read), not ours to read (EACCES), or an I/O error
        return None
    return owner_of(text)


def container_id(status_value: str) -> str:
    """The bare id in a `status.containerStatuses[].containerID` (`containerd://<id>`, `cri-o://<id>`,
    `docker://<id>`); a value without a scheme is already bare."""
    _, scheme_end, bare = status_value.partition("://")
    return bare if scheme_end else status_value


def _owner_in(path: str) -> Owner | None:
    """The owner named by one cgroup path: the first pod segment in it and the segment below."""
    parts = [part for part in path.split("/") if part]
    for at, part in enumerate(parts):
        if pod := _SYSTEMD_POD.fullmatch(part):
            return _with_container(pod["uid"].replace("_", "-"), parts[at + 1 :], _SYSTEMD_CONTAINER)
        if (pod := _CGROUPFS_POD.fullmatch(part)) and _under_kubepods(parts[:at]):
            return _with_container(pod["uid"], parts[at + 1 :], _CGROUPFS_CONTAINER)
    return None


def _under_kubepods(above: Sequence[str]) -> bool:
    """Whether a cgroupfs pod segment with these ancestors is the kubelet's (`kubepods[/<qos>]`, or `..`)."""
    parents = above[:-1] if above and above[-1] in _QOS else above
    return bool(parents) and parents[-1] in _KUBEPODS_PARENTS


def _with_container(pod_uid: str, below: Sequence[str], container: re.Pattern[str]) -> Owner | None:
    if not below:
        return Owner(pod_uid, None)
    scope = container.fullmatch(below[0])
    return Owner(pod_uid, scope["id"]) if scope else None
