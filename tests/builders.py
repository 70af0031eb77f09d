"""Test builders: the objects tests post to the (fake or real) API server, built call by call in the
style of kube-scheduler's test wrappers (`MakePod("a", "ns").node("n0").container(limits=...).obj()`),
the allocations sharegpu writes on pods, one manual clock, and the fake NVML's file.

Every builder starts from the smallest object of its kind (apiVersion, kind, name; a pod's annotations
too, for the tests that add to them) and adds only what it is told; `obj()` returns a fresh copy of the
raw JSON (so one builder can make several objects), `wire()` the object decoded as the product decodes
it. Test modules import these (and conftest helpers), never each other: pyproject.toml's import-linter
contract "Test modules do not import each other" (tests/contracts.py) says so."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from sharegpu.api import devices as api_devices
from sharegpu.api import dra, names, pods, wire
from sharegpu.core import allocation, devices, requests, units
from sharegpu.devcluster.containerd import BUSYBOX_IMAGE

Json = dict[str, Any]


class Clock:
    """A manual clock: call it for the time, which moves only when the test sets `now` or advances it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the time on by `seconds`; returns the new time."""
        self.now += seconds
        return self.now


def gpu_limits(
    *, count: int = 1, milli: int | None = None, memory: int | None = None, nvidia: int | None = None,
    cpu: str = "100m", host_memory: str = "64Mi",
) -> dict[str, str]:  # fmt: skip
    """A GPU container's limits: `nvidia` whole GPUs from the device plugin, or `count` sharegpu GPUs
    with `milli` of each one's compute and `memory` MiB of each one's memory (where given)."""
    limits = {"cpu": cpu, "memory": host_memory}
    if nvidia is not None:
        limits[names.NVIDIA_GPU] = str(nvidia)
        return limits
    limits[names.GPU] = str(count)
    if milli is not None:
        limits[names.GPU_MILLI] = str(milli)
    if memory is not None:
        limits[names.GPU_MEMORY] = str(memory)
    return limits


def _container(
    name: str = "main",
    *,
    image: str | None = None,
    limits: Mapping[str, str] | None = None,
    requests: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Json:
    """A container: resources only where limits or requests are given, env as name/value pairs."""
    made: Json = {"name": name}
    if image is not None:
        made["image"] = image
    if env is not None:
        made["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if limits is not None or requests is not None:
        resources: Json = {}
        if limits is not None:
            resources["limits"] = dict(limits)
        if requests is not None:
            resources["requests"] = dict(requests)
        made["resources"] = resources
    return made


class _Builder:
    """What the object builders share: the object so far, its labels, and fresh copies of it."""

    def __init__(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        metadata: Json = {"name": name}
        if namespace is not None:
            metadata["namespace"] = namespace
        self._obj: Json = {"apiVersion": api_version, "kind": kind, "metadata": metadata}

    def labels(self, labels: Mapping[str, str]) -> Self:
        self._obj["metadata"].setdefault("labels", {}).update(labels)
        return self

    def obj(self) -> Json:
        made: Json = copy.deepcopy(self._obj)
        return made


class MakePod(_Builder):
    """A Pod: metadata (annotations always present, empty until set), a spec with the containers added
    so far, and a status only where set."""

    def __init__(self, name: str = "p", namespace: str | None = None) -> None:
        super().__init__("v1", "Pod", name, namespace)
        self._obj["metadata"]["annotations"] = {}
        self._obj["spec"] = {"containers": []}

    @property
    def _meta(self) -> Json:
        meta: Json = self._obj["metadata"]
        return meta

    @property
    def _spec(self) -> Json:
        spec: Json = self._obj["spec"]
        return spec

    @property
    def _status(self) -> Json:
        status: Json = self._obj.setdefault("status", {})
        return status

    # ----------------------------------------------------------------------------- metadata

    def uid(self, uid: str) -> Self:
        self._meta["uid"] = uid
        return self

    def annotations(self, annotations: Mapping[str, str]) -> Self:
        self._meta["annotations"].update(annotations)
        return self

    def allocation(self, alloc: allocation.Allocation | str) -> Self:
        """sharegpu's allocation annotation (an Allocation, or its text as written)."""
        return self.annotations({names.ALLOCATION: alloc if isinstance(alloc, str) else alloc.to_json()})

    def owner(self, reference: Json) -> Self:
        self._meta.setdefault("ownerReferences", []).append(dict(reference))
        return self

    def created(self, timestamp: str) -> Self:
        self._meta["creationTimestamp"] = timestamp
        return self

    # ----------------------------------------------------------------------------- spec

    def container(
        self,
        name: str = "main",
        *,
        image: str | None = None,
        limits: Mapping[str, str] | None = None,
        requests: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Self:
        self._spec["containers"].append(_container(name, image=image, limits=limits, requests=requests, env=env))
        return self

    def init_container(self, name: str, *, image: str | None = None, limits: Mapping[str, str] | None = None) -> Self:
        self._spec.setdefault("initContainers", []).append(_container(name, image=image, limits=limits))
        return self

    def node(self, name: str) -> Self:
        """Bound to `name` (spec.nodeName)."""
        self._spec["nodeName"] = name
        return self

    def scheduler(self, name: str = names.SCHEDULER_NAME) -> Self:
        self._spec["schedulerName"] = name
        return self

    def node_selector(self, selector: Mapping[str, str]) -> Self:
        self._spec["nodeSelector"] = dict(selector)
        return self

    def priority(self, priority: int) -> Self:
        self._spec["priority"] = priority
        return self

    def grace(self, seconds: int) -> Self:
        self._spec["terminationGracePeriodSeconds"] = seconds
        return self

    def restricted(self) -> Self:
        """Every container so far as PodSecurity's `restricted` level asks (sharegpu-gpus enforces it)."""
        for container in self._spec["containers"]:
            container["securityContext"] = copy.deepcopy(pods.RESTRICTED)
        return self

    def spec(self, **fields: Any) -> Self:
        """Any other spec fields, as the API spells them."""
        self._spec.update(fields)
        return self

    # ----------------------------------------------------------------------------- status

    def phase(self, phase: str) -> Self:
        self._status["phase"] = phase
        return self

    def scheduled_at(self, seconds: int) -> Self:
        """The PodScheduled=True condition, at `seconds` (when it was bound)."""
        condition = {"type": "PodScheduled", "status": "True", "lastTransitionTime": wire.timestamp(seconds)}
        self._status.setdefault("conditions", []).append(condition)
        return self

    def status(self, **fields: Any) -> Self:
        """Any other status fields, as the API spells them."""
        self._status.update(fields)
        return self

    def claim(self, claim: str, name: str = "gpu", *, container: int = 0) -> Self:
        """Use the ResourceClaim `claim` (as `spec.resourceClaims[name]`, in the `container`th container)."""
        self._spec.setdefault("resourceClaims", []).append({"name": name, "resourceClaimName": claim})
        resources = self._spec["containers"][container].setdefault("resources", {})
        resources.setdefault("claims", []).append({"name": name})
        return self

    def busybox(self, command: str = "sleep 3600") -> Self:
        """Every container (add them first) runs `command` in the busybox image the real-container
        nodes have (`devcluster.containerd.BUSYBOX_IMAGE`, never pulled); no service account token."""
        for container in self._spec["containers"]:
            container.update({"image": BUSYBOX_IMAGE, "command": ["sh", "-c", command], "imagePullPolicy": "Never"})
        self._spec["automountServiceAccountToken"] = False
        return self

    def gate(self, gate: str = names.DRA_GATE) -> Self:
        self._spec.setdefault("schedulingGates", []).append({"name": gate})
        return self

    def wire(self) -> wire.Pod:
        return wire.convert(self._obj, wire.Pod)


class MakeClaim(_Builder):
    """A ResourceClaim (resource.k8s.io/v1) with requests of sharegpu's class (or another)."""

    def __init__(self, name: str = "c", namespace: str | None = "ns") -> None:
        super().__init__("resource.k8s.io/v1", "ResourceClaim", name, namespace)
        self._obj["spec"] = {"devices": {"requests": []}}

    def ask(
        self,
        milli: int | None = None,
        memory: str | None = None,
        *,
        count: int = 1,
        request: str = "gpu",
        device_class: str = dra.CLASS,
        **exactly: Any,
    ) -> Self:
        capacity = {k: v for k, v in ((dra.MILLI, None if milli is None else str(milli)), (dra.MEMORY, memory)) if v}
        body: Json = {"deviceClassName": device_class, "count": count, **exactly}
        if capacity:
            body["capacity"] = {"requests": capacity}
        self._obj["spec"]["devices"]["requests"].append({"name": request, "exactly": body})
        return self

    def constraint(self, **constraint: Any) -> Self:
        """A constraint between its devices (matchAttribute=..., distinctAttribute=...)."""
        self._obj["spec"]["devices"].setdefault("constraints", []).append(dict(constraint))
        return self

    def config(self, driver: str = dra.DRIVER, parameters: Json | None = None) -> Self:
        """Opaque parameters for `driver`."""
        opaque = {"driver": driver, "parameters": parameters or {}}
        self._obj["spec"]["devices"].setdefault("config", []).append({"opaque": opaque})
        return self


class MakeNode(_Builder):
    """A Node: labels, taints, allocatable resources and readiness only where set."""

    def __init__(self, name: str = "n0") -> None:
        super().__init__("v1", "Node", name)

    def taints(self, taints: Sequence[Mapping[str, str]]) -> Self:
        self._obj.setdefault("spec", {})["taints"] = [dict(t) for t in taints]
        return self

    def allocatable(self, resources: Mapping[str, str]) -> Self:
        self._obj.setdefault("status", {})["allocatable"] = dict(resources)
        return self

    def ready(self, ready: bool = True) -> Self:
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        self._obj.setdefault("status", {})["conditions"] = [condition]
        return self

    def wire(self) -> wire.Node:
        return wire.convert(self._obj, wire.Node)


class MakeDevice:
    """A sharegpu.io Device, as the node agent publishes it for a node of identical GPUs (none until
    `gpus` says how many)."""

    def __init__(self, node: str = "n0") -> None:
        self.node = node
        self.inventory: devices.NodeInventory | None = None
        self._dra = False

    def dra(self, serves: bool = True) -> Self:
        """The node serves DRA claims only (its agent runs with --dra)."""
        self._dra = serves
        return self

    def gpus(self, count: int, model: str = "T4", memory: int = 16384, *, cpu: int = 1, host_memory: int = 1) -> Self:
        self.inventory = devices.uniform_node(
            self.node, gpu_count=count, model=model, gpu_memory_mib=memory, cpu_milli=cpu, memory_mib=host_memory
        )
        return self

    def obj(self) -> Json:
        if self.inventory is None:
            return {
                "apiVersion": names.GROUP_VERSION,
                "kind": names.DEVICE_KIND,
                "metadata": {"name": self.node},
                "spec": {"gpus": []},
            }
        made = wire.encode(api_devices.device(self.inventory))
        if self._dra:
            made["spec"]["dra"] = True
        return made

    def wire(self) -> wire.Device:
        return wire.convert(self.obj(), wire.Device)


class MakePDB(_Builder):
    """A policy/v1 PodDisruptionBudget selecting pods by labels or expressions."""

    def __init__(self, name: str, namespace: str | None = None) -> None:
        super().__init__("policy/v1", "PodDisruptionBudget", name, namespace)
        self._obj["spec"] = {}

    def min_available(self, count: int | str) -> Self:
        self._obj["spec"]["minAvailable"] = count
        return self

    def max_unavailable(self, count: int | str) -> Self:
        self._obj["spec"]["maxUnavailable"] = count
        return self

    def match_labels(self, labels: Mapping[str, str]) -> Self:
        self._obj["spec"]["selector"] = {"matchLabels": dict(labels)}
        return self

    def match_expression(self, key: str, operator: str, *values: str) -> Self:
        selector = self._obj["spec"].setdefault("selector", {})
        selector.setdefault("matchExpressions", []).append({"key": key, "operator": operator, "values": list(values)})
        return self


class MakeAllocation:
    """sharegpu's allocation of a pod on a node: grants per container, in the order they are added."""

    def __init__(self, pod: str = "ns/p", node: str = "n0") -> None:
        self.pod = units.PodKey(pod)
        self.node = units.NodeName(node)
        self._containers: dict[str, list[allocation.DeviceGrant]] = {}
        self._fields: dict[str, Any] = {}

    def grant(
        self,
        index: int,
        milli: int,
        memory: int = 0,
        *,
        limit: int | None = None,
        uuid: str | None = None,
        container: str = "main",
    ) -> Self:
        """`milli` of GPU `index`'s compute and `memory` MiB of its memory to `container` (limited
        to `limit` milli, by default what it is granted)."""
        made = allocation.DeviceGrant(index, milli, memory, milli if limit is None else limit, uuid)
        self._containers.setdefault(container, []).append(made)
        return self

    def grants(self, *grants: tuple[int, int, int], container: str = "main") -> Self:
        """(GPU index, milli, memory MiB) grants to `container`, each limited to what it is granted."""
        self.container(container)
        for index, milli, memory in grants:
            self.grant(index, milli, memory, container=container)
        return self

    def container(self, name: str) -> Self:
        """A container that holds no GPU (so far)."""
        self._containers.setdefault(name, [])
        return self

    def host(self, cpu_milli: int, memory_mib: int) -> Self:
        self._fields.update(cpu_milli=cpu_milli, memory_mib=memory_mib)
        return self

    def exclusive(self, exclusive: bool = True) -> Self:
        self._fields["exclusive"] = exclusive
        return self

    def cotenancy(self, rules: requests.CoTenancy) -> Self:
        self._fields["cotenancy"] = rules
        return self

    def obj(self) -> allocation.Allocation:
        containers = tuple(allocation.ContainerAllocation(name, tuple(held)) for name, held in self._containers.items())
        return allocation.Allocation(self.pod, self.node, containers, **self._fields)

    def json(self) -> str:
        """The annotation's text."""
        return self.obj().to_json()


# ---------------------------------------------------------------------------------------- fake NVML

NVML_PROCESSES = "processes: [{pid: 42, gpu: 2, usedMiB: 2048}]"
"""`NVML_FILE`'s process line."""
NVML_FILE = f"""
gpus:
  - {{uuid: GPU-0, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, pcieSwitch: 0}}
  - {{uuid: GPU-1, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, pcieSwitch: 0}}
  - {{uuid: GPU-2, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, numaNode: 1}}
nvlinks: [{{a: 0, b: 1, count: 12}}]
{NVML_PROCESSES}
"""
"""The fake NVML's file for a node of three A100s (two NVLinked), one process on the third."""


def nvml_with(*processes: str) -> str:
    """`NVML_FILE` with these processes instead of its one, each a flow map such as
    `{pid: 4242, gpu: 0, usedMiB: 1500, smPercent: 25}` (none: no process)."""
    return NVML_FILE.replace(NVML_PROCESSES, f"processes: [{', '.join(processes)}]")


def pod_process(proc: Path, pid: int, pod_uid: str) -> None:
    """A process of the pod `pod_uid` as the agent finds it under `proc` (its /proc): PID's cgroup is
    a container's of that pod (cgroup v2, cgroupfs driver)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/burstable/pod{pod_uid}/{'b' * 64}\n")


def write_bytes(path: Path, data: bytes) -> None:
    """Replace a file with a new modification time, however fast the test (the fake NVML, and the
    agent's libraries, are re-read when theirs changes)."""
    path.write_bytes(data)
    stamp = path.stat().st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def write_nvml(path: Path, text: str) -> None:
    """Write the fake NVML's file (`write_bytes`, as text)."""
    write_bytes(path, text.encode())


def write_trace(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, Path]:
    """A small openb trace in `tmp_path`: four T4 nodes of 2 or 4 GPUs, 30 pods of one GPU or a share."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(f"n{i},{16000},{32768},{int(rng.choice([2, 4]))},T4\n" for i in range(4))
    )
    pods = tmp_path / "openb_pod_list_tiny.csv"
    rows = [f"p{i},{int(rng.choice([500, 2000]))},1024,1,{int(rng.choice([250, 500, 810, 1000]))}\n" for i in range(30)]
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(rows))
    return nodes, pods
