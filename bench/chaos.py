"""Chaos: churn through the real stack while every fault the extender must survive is injected at
random points; afterwards an oracle that reads only the API checks every GPU.

The stack is the local control plane, kube-scheduler, the extender (as its ServiceAccount, with a
token file the "kubelet" rotates) and the fake-cluster harness. The extender reaches the API server
through a fault proxy (`sharegpu.devcluster.faults`). Churn creates and deletes sharing pods (with a
hand-off ConfigMap, as the webhook would give them), whole-GPU pods and two-GPU pods. Faults, each
several times at random moments: 429 with Retry-After, 409 on bindings, 5xx, watch connections cut,
watches expired (410), a 1.2 MiB pod, a rotated and revoked token, SIGKILL of the extender, a
restart of kube-apiserver and a restart of etcd; and writes the API server carried out whose answer
was lost: bindings answered by a closed connection or by a 503, and any creation or deletion
(reservation pods, hand-off ConfigMaps) answered by a closed connection. Pods have a low priority,
and 15% a high one: when the cluster fills up, those preempt low pods (the extender's preemption
runs under the same faults).

With `--dra`, half the nodes serve DRA claims (as agents run with --dra leave them: a Device that
says so and a ResourceSlice), sharegpu's DeviceClass exists, and 40% of the churn's pods ask the DRA
way, as the webhook writes them: gated, their GPU a claim of their own by name
(`sharegpu-1x<milli>m-<MiB>mi-c<random>`, which the allocator makes for the pod). The extender then
also allocates claims under the faults, and more kinds hit it: 409 on its claim writes, claim writes
and gate lifts the API server carried out whose answer was lost, DeviceTaintRules (NoSchedule) put
on a random DRA GPU and taken away a few seconds later (all gone before the verdict), and claims
shared by two pods (a ResourceClaim by name, both pods gated on it). Two extender replicas then
elect a leader (on shorter terms: `ELECTION`, `FENCE`), each through its own proxy on a token bound
to a pod of its own, as the chart's replicas are, so that the
`sharegpu-leader` policy judges their claim writes; a killed extender is either replica, and one
more fault: a write delayed across a leader change (the leader's next claim write held in its proxy
while the leader stalls, until the other has taken the Lease and waited out its fence; then it goes
on, and the API server must refuse it). The oracle then counts claims in the same ledger as the pods
(`oracle.inspect` with claims), each shared claim once.

With `--gangs SHARE`, that share of the churn's creations are gangs instead of single pods: 2 to 4
sharing pods (`sharegpu.io/gang`, the minimum their number, a timeout of 20 s) created one after
another, of the high priority (so that nothing preempts a member) and never deleted by the churn.
The verdict then also counts partial_gangs: gangs with some but fewer than their minimum of members
bound at the end; leaked_gang_plans: released plans still kept in the API (ConfigMaps) with no
member left to bind (every one bound, gone or replaced) once the extender has had a minute to delete
them; and judges pending gang members as gangs (stuck only if the whole gang fits).

    python bench/chaos.py --nodes 50 --pods 600 [--dra] [--gangs 0.1] [--seeds 1-20] [--json PATH] [--logs DIR]

Each seed is one run on a fresh stack. Writes {"runs": [{"seed", "faults_injected", "overcommits",
"double_allocations", "leaked_reservations", "leaked_allocations", "stuck_pods", "lost_pods",
"wrong_preemptions", "late_writes_landed", "partial_gangs", "leaked_gang_plans",
"late_write_answers", "preempted", "faults", "pending_settled_s", "details", ...}], "all_zero"} (target: at least 20
faults per run, every other figure 0 on every seed). The exit status is 1 when any seed found a
problem. "details" names what each count found (twenty at most);
its "why_stuck" gives, for stuck pods still pending, their scheduling gates, nominated node,
PodScheduled condition and newest event.

- overcommits / double_allocations: GPUs over capacity, or held whole and shared, at any check
  during the churn or after it (double_allocations also counts two live reservation pods on one GPU);
- leaked_reservations: reservation pods for GPUs nobody shares, once the churn is over and the
  reservation idle time has passed;
- leaked_allocations: claims allocated on sharegpu's GPUs that no live pod uses, once the churn is
  over and the allocator's time to clear unused allocations has passed;
- stuck_pods: pods still pending at the end (after SETTLE seconds in which no pod was bound, created,
  deleted or ungated, at most QUIET_MAX seconds in all) although the cluster
  has room for them (judged by the placement core over what the API holds; a DRA pod, by the free
  capacity of the DRA nodes' GPUs after the claims), bound pods without a valid allocation (or whose
  claim is not allocated on their node), and bound sharing pods whose hand-off ConfigMap never got
  their GPU (again after up to SETTLE seconds: the extender's watches may be backing off after the
  last restart);
- lost_pods: pods the churn created and did not delete that are gone, unless an event says they
  were preempted;
- wrong_preemptions: preempted pods of the high priority (nothing outranks them);
- late_writes_landed: claim writes delayed across a leader change that the API server took.
"preempted" (not a problem) counts the pods preempted; "pending_settled_s" says how long the verdict
waited for the pending pods to settle (0 when none that fit was pending; QUIET_MAX when they never
did).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sharegpu.api import devices as api_devices
from sharegpu.api import dra, names, paths, pods, wire
from sharegpu.api import gangs as api_gangs
from sharegpu.core import devices, fleet, policies
from sharegpu.core import gangs as core_gangs
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.devcluster import controlplane, fakecluster, faults, oracle, stack
from sharegpu.kube import client, leader
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]
NS = "chaos"
SETTLE = 60
"""Seconds pending pods that fit may take to be placed once the churn is over, before they count as
stuck: after an API server restart, kube-scheduler 1.37's informers can back off for up to 30 s
(seen: requests refused as forbidden for a moment after the restart, while RBAC loads). The window
starts again whenever the pods change (`settled_pending`), up to QUIET_MAX seconds in all."""
QUIET_MAX = 240
"""Seconds at most that the verdict waits for pods that fit to be placed while the pods keep changing:
a preemption late in the window frees room for its preemptor, which the verdict (reading the API)
would count as free for every pending pod until the preemptor is bound."""


CLASSES = {"chaos-low": 100, "chaos-high": 1000}
"""PriorityClasses of the churn's pods."""
HIGH = 0.15
"""Share of pods with the high priority."""
DELETE_SHARE = 0.35
"""Chance that a pod is deleted after each creation (once 40 are live): the cluster fills up in the
last third of the churn, so pods wait and the high-priority ones preempt."""
DRA_SHARE = 0.4
"""With --dra: share of pods that ask the DRA way."""
DRA_MEMORY_MIB = 2048
"""With --dra: the GPU memory each DRA pod's claim asks."""
UNUSED_CLEARED = 30
"""Seconds after which the allocator clears an allocation no pod uses (`extender.allocator`)."""


def pod_body(rng: random.Random, name: str, *, dra_share: float = 0.0) -> Json:
    kind = rng.random()
    priority = "chaos-high" if rng.random() < HIGH else "chaos-low"
    limits: dict[str, str] = {"cpu": "100m", "memory": "64Mi"}
    if rng.random() < dra_share:
        return dra_pod_body(name, priority, rng.choice([100, 200, 250, 300, 500, 700]), limits)
    annotations: dict[str, str] = {}
    if kind < 0.7:
        limits.update({names.GPU: "1", names.GPU_MILLI: str(rng.choice([100, 200, 250, 300, 500, 700]))})
        annotations[names.HANDOFF] = f"sharegpu-handoff-{uuid.uuid4().hex[:16]}"
    elif kind < 0.9:
        limits[names.NVIDIA_GPU] = "1"
    else:
        limits.update({names.GPU: "2", names.GPU_MILLI: "400"})
        annotations[names.HANDOFF] = f"sharegpu-handoff-{uuid.uuid4().hex[:16]}"
    return sharing_body(name, priority, limits, annotations)


def sharing_body(name: str, priority: str, limits: dict[str, str], annotations: dict[str, str]) -> Json:
    """A pod of the churn for sharegpu's scheduler: one container asking `limits`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "priorityClassName": priority,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


GANG_TIMEOUT = 20
"""With --gangs: the gangs' timeout (seconds a placed gang has to be bound)."""


def gang_bodies(rng: random.Random, gang: str) -> list[Json]:
    """A gang of 2 to 4 sharing pods, of the high priority."""
    size = rng.choice([2, 3, 4])
    milli = rng.choice([300, 500, 700])
    out = []
    for index in range(size):
        limits = {"cpu": "100m", "memory": "64Mi", names.GPU: "1", names.GPU_MILLI: str(milli)}
        annotations = {
            names.HANDOFF: f"sharegpu-handoff-{uuid.uuid4().hex[:16]}",
            names.GANG: gang, names.GANG_MIN: str(size), names.GANG_TIMEOUT: str(GANG_TIMEOUT),
        }  # fmt: skip
        out.append(sharing_body(f"{gang}-{index}", "chaos-high", limits, annotations))
    return out


def dra_pod_body(name: str, priority: str, milli: int, limits: dict[str, str]) -> Json:
    """A pod that asks the DRA way, as the webhook leaves it: gated, a claim of its own by name."""
    shape = dra.Shape(1, milli, memory_mib=DRA_MEMORY_MIB)
    claim = shape.claim_name(os.urandom(dra.POD_CLAIM_TOKEN_BYTES))
    container = {"name": "main", "image": "busybox",
                 "resources": {"limits": limits, "requests": limits, "claims": [{"name": dra.POD_CLAIM}]}}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "priorityClassName": priority,
            "terminationGracePeriodSeconds": 0,
            "schedulingGates": [{"name": names.DRA_GATE}],
            "resourceClaims": [{"name": dra.POD_CLAIM, "resourceClaimName": claim}],
            "containers": [container],
        },
    }


ELECTION = ("--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1")
"""With --dra: two extender replicas elect a leader on shorter terms than the chart's (15, 10, 2 s), so
that a leader change fits a run."""
FENCE = 8.0
"""With --dra: the replicas' --dra-fence (more than a Lease's duration past its renew deadline, as
`extender.allocator.FENCE` is for the chart's terms)."""


@dataclass
class Replica:
    """One extender process, its fault proxy and its token file; with --dra, the pod its token is bound to."""

    pod: str
    token_file: Path
    proxy: faults.FaultProxy
    process: stack.ExtenderProcess
    args: tuple[str, ...]

    def start(self) -> None:
        """(Re)start the process; with a pod, as a new candidate for the Lease whose identity names it."""
        self.process.extra = (*self.args, "--identity", leader.identity(self.pod)) if self.pod else self.args
        self.process.start()

    def write_token(self, token: str) -> None:
        temporary = self.token_file.with_suffix(".tmp")
        temporary.write_text(token)
        temporary.replace(self.token_file)


class Chaos:
    def __init__(
        self,
        workdir: Path,
        nodes: int,
        rng: random.Random,
        *,
        dra: bool = False,
        log_level: str = "WARNING",
        gangs: float = 0.0,
    ) -> None:
        self.log_level = log_level
        self.gang_share = gangs
        self.gangs: dict[str, list[str]] = {}
        """Gang -> its members' names."""
        self.plane = controlplane.ControlPlane(workdir, controlplane.binaries())
        self.workdir = workdir
        self.nodes = nodes
        self.rng = rng
        self.admin: client.KubeClient | None = None
        self.harness: fakecluster.FakeCluster | None = None
        self.replicas: list[Replica] = []
        self.secret = ""
        self.faults: dict[str, int] = {}
        self.created: set[str] = set()
        self.high: set[str] = set()
        self.deleted: set[str] = set()
        self.overcommits: set[str] = set()
        self.doubles: set[str] = set()
        self.dra = dra
        self.dra_created = 0
        self.taint_rules: set[str] = set()
        self.untainting: list[asyncio.Task[None]] = []
        self.late_writes_landed: list[str] = []
        """Claim writes an old leader sent, held past a leader change, that the API server took."""
        self.late_answers: dict[int, int] = {}
        """The API server's answers to those writes (403: the policy; 409: the claim changed since), by
        status (0: the fault found nothing to hold)."""

    @property
    def proxy(self) -> faults.FaultProxy:
        """The proxy of the replica kube-scheduler calls (the only one without --dra)."""
        return self.replicas[0].proxy

    @property
    def extender(self) -> stack.ExtenderProcess:
        return self.replicas[0].process

    @property
    def api(self) -> client.KubeClient:
        assert self.admin is not None
        return self.admin

    def count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    # ----------------------------------------------------------------- set-up

    async def start(self) -> None:
        self.plane.start()
        self.admin = stack.kube_for(self.plane, "admin", connections=64)
        await stack.install(self.api)
        account = {"name": "sharegpu-extender", "namespace": names.SYSTEM_NAMESPACE}
        await stack.apply(self.api, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account})
        for doc in stack.manifests("files/rbac/extender.yaml"):  # bound to the ServiceAccount, as the chart binds them
            doc["metadata"]["name"] += "-sa"
            if doc["kind"].endswith("Binding"):
                doc["roleRef"]["name"] += "-sa"
            await stack.apply(self.api, doc)
        assert self.plane.bundle is not None
        for n in range(2 if self.dra else 1):
            pod = await self.replica_pod(f"sharegpu-extender-{n}") if self.dra else ""
            proxy = faults.FaultProxy(self.plane.url, str(self.plane.bundle.ca_cert))
            await proxy.start()
            token_file = self.workdir / f"token-{n}"
            kubeconfig = self.workdir / f"extender-kubeconfig-{n}"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": proxy.url}}],
                "users": [{"name": "sa", "user": {"tokenFile": str(token_file)}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "sa"}}],
            }))  # fmt: skip
            args = (*ELECTION, "--dra-fence", str(FENCE)) if self.dra else ("--no-leader-elect",)
            args = (*args, "--log-level", self.log_level)
            process = stack.ExtenderProcess(self.plane, "fgd-used", *args, kubeconfig=kubeconfig)
            self.replicas.append(Replica(pod, token_file, proxy, process, args))
        await self.rotate_token(count=False)
        for replica in self.replicas:
            replica.start()
            await replica.process.wait_ready(timeout=120)
        self.plane.start_scheduler(stack.scheduler_config(self.plane, self.extender))
        self.harness = fakecluster.FakeCluster(self.api)
        await self.harness.start()
        made = [
            devices.uniform_node(
                f"c{i:03d}", gpu_count=4, model="T4", gpu_memory_mib=16384, cpu_milli=32000, memory_mib=131072
            )
            for i in range(self.nodes)
        ]
        served = self.nodes // 2 if self.dra else 0  # the first half serve DRA claims
        if served:
            await self.api.create(dra.DEVICE_CLASSES, dra.device_class())
            await self.harness.add_nodes(made[:served], dra=True)
        await self.harness.add_nodes(made[served:])
        await self.api.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for name, value in CLASSES.items():
            body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                    "value": value}  # fmt: skip
            await self.api.create("/apis/scheduling.k8s.io/v1/priorityclasses", body)

    async def stop(self) -> None:
        """Stop everything, whatever failed (a broken part must not keep the others running)."""
        for part in (self.harness, *(r.proxy for r in self.replicas)):
            if part is not None:
                try:
                    await part.stop()
                except Exception as exc:
                    print(f"stop: {exc}", file=sys.stderr)
        if self.admin is not None:
            await self.admin.close()
        for replica in self.replicas:
            replica.process.resume()
            replica.process.kill()
        self.plane.stop()

    # ----------------------------------------------------------------- faults

    async def replica_pod(self, name: str) -> str:
        """A pod of the extender's ServiceAccount that no scheduler places, for a replica's token to be
        bound to (as the kubelet binds a projected token to its pod): the `sharegpu-leader` policy
        judges the claim writes of such a token by the Lease's holder."""
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": names.SYSTEM_NAMESPACE},
                "spec": {"schedulerName": "chaos-nobody", "serviceAccountName": "sharegpu-extender",
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [{"name": "extender", "image": "sharegpu",
                                         "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}}  # fmt: skip
        await self.api.create(paths.pods(names.SYSTEM_NAMESPACE), body)
        return name

    async def rotate_token(self, count: bool = True) -> None:
        """What the kubelet does with a projected token: a new one in the file. Without --dra the token
        is bound to a Secret, which is then deleted (the old token dies); with --dra each replica's is
        bound to its pod, and the old one lives on until it expires, as the kubelet's rotation leaves it."""
        if self.dra:
            for replica in self.replicas:
                pod = await self.api.get(paths.pod(names.SYSTEM_NAMESPACE, replica.pod))
                token = await stack.issue_token(self.api, names.SYSTEM_NAMESPACE, "sharegpu-extender", pod)
                replica.write_token(token)
            if count:
                self.count("token-rotated")
            return
        old = self.secret
        self.secret = f"extender-token-{uuid.uuid4().hex[:6]}"
        made = await self.api.create(
            paths.secrets(names.SYSTEM_NAMESPACE),
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": self.secret}, "type": "Opaque"},
        )
        ref = {"apiVersion": "v1", "kind": "Secret", "name": self.secret, "uid": made["metadata"]["uid"]}
        answer = await self.api.create(
            f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/serviceaccounts/sharegpu-extender/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": 3600, "boundObjectRef": ref}},
        )  # fmt: skip
        self.replicas[0].write_token(answer["status"]["token"])
        if old:
            await self.api.delete(f"{paths.secrets(names.SYSTEM_NAMESPACE)}/{old}")
        if count:
            self.count("token-rotated-and-revoked")

    async def leader(self) -> Replica | None:
        """The replica whose pod holds the Lease now (None: none does)."""
        try:
            lease = await self.api.get(paths.lease(names.SYSTEM_NAMESPACE, names.EXTENDER_LEASE))
        except kube_errors.KubeError:
            return None
        holder = lease.get("spec", {}).get("holderIdentity") or ""
        return next((r for r in self.replicas if holder.startswith(r.pod + leader.SEPARATOR)), None)

    async def late_write(self) -> None:
        """An old leader's claim write held in flight past a leader change: the leader's next write of a
        claim is held in its proxy, the leader stalls (SIGSTOP) until the other replica holds the Lease
        and has waited out its fence (placing the claims meanwhile), then the write goes on. The API
        server must refuse it (the `sharegpu-leader` policy, or a 409 when the claim changed since)."""
        old = await self.leader()
        if old is None:
            self.late_answers[0] = self.late_answers.get(0, 0) + 1  # not thrown: nobody led
            return
        held = old.proxy.hold("PATCH", f"/apis/{dra.GROUP}/", contains="/resourceclaims/")
        name = f"late-{uuid.uuid4().hex[:6]}"  # a claim to write, whatever the churn asks meanwhile
        await self.guarded(lambda: self.api.create(paths.pods(NS), dra_pod_body(name, "chaos-low", 100, {})))
        self.created.add(name)
        self.dra_created += 1
        try:
            await asyncio.wait_for(held.arrived.wait(), timeout=60)
        except TimeoutError:
            held.release()
            self.late_answers[0] = self.late_answers.get(0, 0) + 1  # not thrown: no write came
            return
        old.process.pause()
        try:
            new = await self.until_leader(lambda r: r is not None and r is not old, timeout=120)
            if new is None:
                raise RuntimeError("no other replica took the Lease from a stalled leader in 120 s")
            # Anywhere from the moment the Lease moved (the claim as the old leader read it: the policy
            # refuses) to past the new leader's fence (which may have written the claim since: a 409).
            await asyncio.sleep(self.rng.uniform(0.0, FENCE + 2))
        finally:
            held.release()
            await held.answered.wait()
            old.process.resume()
        print(f"    held {held.request}: answered {held.status} after the leader changed", flush=True)
        self.late_answers[held.status] = self.late_answers.get(held.status, 0) + 1
        if 200 <= held.status < 300:
            self.late_writes_landed.append(f"{held.request} ({held.status})")

    async def until_leader(self, wanted: Any, timeout: float) -> Replica | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = await self.leader()
            if wanted(found):
                return found
            await asyncio.sleep(0.5)
        return None

    async def inject(self, kind: str) -> None:
        proxy = self.proxy
        if kind.startswith(("claim-", "gate-")):  # the leader's writes
            proxy = (await self.leader() or self.replicas[0]).proxy
        if kind == "429":
            proxy.fail(429, times=5, retry_after=1)
        elif kind == "409":
            proxy.fail(409, times=2, method="POST", path="/api/v1/namespaces/")
        elif kind == "5xx":
            proxy.fail(self.rng.choice([500, 503]), times=4)
        elif kind == "binding-answer-lost":
            proxy.lose(times=2, method="POST", ending="/binding")
        elif kind == "binding-503-after-commit":
            proxy.fail(503, times=2, method="POST", ending="/binding", after_commit=True)
        elif kind == "write-answer-lost":
            proxy.lose(times=3, method=self.rng.choice(["POST", "DELETE"]), path="/api/v1/namespaces/")
        elif kind == "watch-cut":
            proxy.cut_watches()
        elif kind == "watch-expired":
            await proxy.expire_watches()
        elif kind == "big-object":
            name = f"big-{uuid.uuid4().hex[:6]}"
            container = {"name": "c", "image": "x", "env": [{"name": "B", "value": "x" * (1200 * 1024)}]}
            spec = {"nodeSelector": {"nowhere": "x"}, "containers": [container]}
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}
            await self.api.create(paths.pods("default"), body)
        elif kind == "token":
            await self.rotate_token(count=False)
        elif kind == "kill-extender":
            victim = self.rng.choice(self.replicas)
            victim.process.kill(signal.SIGKILL)
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))
            victim.start()
            await victim.process.wait_ready(timeout=120)
        elif kind == "claim-409":
            proxy.fail(409, times=2, method="PATCH", path=f"/apis/{dra.GROUP}/")
        elif kind == "claim-answer-lost":
            proxy.lose(times=2, method="PATCH", path=f"/apis/{dra.GROUP}/")
        elif kind == "gate-answer-lost":
            proxy.lose(times=2, method="PATCH", path=f"/api/v1/namespaces/{NS}/pods/")
        elif kind == "taint-rule":
            await self.taint_for_a_while()
        elif kind == "shared-claim":
            await self.shared_claim()
        elif kind == "late-write":
            await self.late_write()
        elif kind in ("kube-apiserver", "etcd"):
            await asyncio.to_thread(self.plane.restart, kind, down_for=self.rng.uniform(0.5, 2.0))
        self.count(kind)

    async def taint_for_a_while(self) -> None:
        """A DeviceTaintRule (NoSchedule) on a random GPU of a DRA node, deleted 2 to 10 s later."""
        name = f"chaos-{uuid.uuid4().hex[:8]}"
        node = f"c{self.rng.randrange(self.nodes // 2):03d}"
        selector = {"driver": dra.DRIVER, "pool": node, "device": dra.device_name(self.rng.randrange(4))}
        body = {"apiVersion": dra.API_VERSION, "kind": "DeviceTaintRule", "metadata": {"name": name},
                "spec": {"deviceSelector": selector, "taint": {"key": "chaos", "value": "maintenance",
                                                              "effect": "NoSchedule"}}}  # fmt: skip
        await self.guarded(lambda: self.api.create(dra.TAINT_RULES, body))
        self.taint_rules.add(name)

        async def untaint() -> None:
            await asyncio.sleep(self.rng.uniform(2.0, 10.0))
            await self.untaint(name)

        self.untainting.append(asyncio.create_task(untaint()))

    async def shared_claim(self) -> None:
        """A ResourceClaim of sharegpu's class used by two new pods (by name), both gated."""
        claim = f"shared-{uuid.uuid4().hex[:8]}"
        milli = self.rng.choice([100, 200, 300])
        request = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS, "capacity": {"requests": {
            dra.MILLI: str(milli), dra.MEMORY: f"{DRA_MEMORY_MIB}Mi"}}}}  # fmt: skip
        body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaim", "metadata": {"name": claim, "namespace": NS},
                "spec": {"devices": {"requests": [request]}}}  # fmt: skip
        await self.guarded(lambda: self.api.create(dra.claim_path(NS), body))
        for n in range(2):
            name = f"{claim}-{n}"
            pod = dra_pod_body(name, "chaos-low", milli, {"cpu": "100m", "memory": "64Mi"})
            pod["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimName": claim}]
            await self.guarded(lambda pod=pod: self.api.create(paths.pods(NS), pod))
            self.created.add(name)
            self.dra_created += 1

    async def untaint_all(self) -> None:
        """Every taint rule gone (before the verdict: room the rules took is room again)."""
        for task in self.untainting:
            task.cancel()
        await asyncio.gather(*self.untainting, return_exceptions=True)
        for name in sorted(self.taint_rules):
            await self.untaint(name)

    async def untaint(self, name: str) -> None:
        with contextlib.suppress(kube_errors.NotFoundError):
            await self.guarded(lambda: self.api.delete(f"{dra.TAINT_RULES}/{name}"))
        self.taint_rules.discard(name)

    # ----------------------------------------------------------------- churn

    async def guarded(self, call: Any) -> None:
        """An admin call that rides out the API server's own restarts."""
        for _ in range(60):
            try:
                await call()
                return
            except (kube_errors.TemporaryError, kube_errors.BusyError):
                await asyncio.sleep(1)
            except kube_errors.ConflictError as exc:
                if exc.already_exists:
                    return
                await asyncio.sleep(0.5)

    async def churn(self, total: int) -> None:
        kinds = ["429", "409", "5xx", "watch-cut", "watch-expired", "big-object", "token", "kill-extender",
                 "kube-apiserver", "etcd", "binding-answer-lost", "binding-503-after-commit",
                 "write-answer-lost"]  # fmt: skip
        if self.dra:
            kinds += ["claim-409", "claim-answer-lost", "gate-answer-lost", "taint-rule", "shared-claim", "late-write"]
        plan = [k for k in kinds for _ in range(2)] + self.rng.sample(kinds, 4)
        self.rng.shuffle(plan)
        at = sorted(self.rng.sample(range(10, total - 10), len(plan)))
        serial = 0
        while serial < total:
            name = f"c{serial:04d}"
            if self.gang_share and self.rng.random() < self.gang_share:
                members = gang_bodies(self.rng, f"g{serial:04d}")
                for body in members:
                    await self.guarded(lambda body=body: self.api.create(paths.pods(NS), body))
                self.gangs[f"g{serial:04d}"] = [b["metadata"]["name"] for b in members]
                self.created.update(self.gangs[f"g{serial:04d}"])
                self.high.update(self.gangs[f"g{serial:04d}"])
                serial += 1
                continue
            body = pod_body(self.rng, name, dra_share=DRA_SHARE if self.dra else 0.0)
            await self.guarded(lambda body=body: self.api.create(paths.pods(NS), body))
            self.created.add(name)
            if body["spec"].get("resourceClaims"):
                self.dra_created += 1
            if body["spec"]["priorityClassName"] == "chaos-high":
                self.high.add(name)
            serial += 1
            in_gangs = {m for names_ in self.gangs.values() for m in names_}
            live = sorted(self.created - self.deleted - in_gangs)  # a gang's members are never deleted
            if len(live) > 40 and self.rng.random() < DELETE_SHARE:
                victim = self.rng.choice(live)
                await self.guarded(lambda victim=victim: self.api.delete(paths.pod(NS, victim), grace_period=0))
                self.deleted.add(victim)
            while at and at[0] <= serial:
                at.pop(0)
                kind = plan.pop(0)
                print(f"  [{serial}/{total}] fault: {kind}", flush=True)
                await self.inject(kind)
            if serial % 50 == 0:
                await self.observe()
            await asyncio.sleep(self.rng.uniform(0.0, 0.05))

    async def observe(self) -> oracle.Findings | None:
        try:
            found = await oracle.inspect(self.api, claims=self.dra)
        except kube_errors.KubeError:
            return None
        self.overcommits.update(found.overcommits)
        self.doubles.update(found.double_allocations)
        self.doubles.update(f"two reservations: {d}" for d in found.duplicate_reservations)
        return found

    # ----------------------------------------------------------------- the verdict

    async def settled_pending(self) -> tuple[list[str], float]:
        """`pending_that_fit` once the pods have been quiet for SETTLE seconds (none bound, created,
        deleted or ungated), or after QUIET_MAX seconds: a pod preempted late frees room that its
        preemptor takes seconds later, and meanwhile the room looks free to every pending pod. With
        the seconds it waited."""
        stuck, seen = await self.pending_that_fit()
        quiet_since = started = time.monotonic()
        while stuck and time.monotonic() - quiet_since < SETTLE and time.monotonic() - started < QUIET_MAX:
            await asyncio.sleep(1)
            stuck, now = await self.pending_that_fit()
            if now != seen:
                seen, quiet_since = now, time.monotonic()
        return stuck, time.monotonic() - started

    async def pending_that_fit(self) -> tuple[list[str], frozenset[tuple[str, str, str, bool, int]]]:
        """Pending pods that the placement core, over what the API holds, says would fit; and the
        pods' state (UID, node, being deleted, gates), whose change tells the verdict to wait on."""
        device_list, _ = await self.api.list_of(paths.DEVICES, wire.Device)
        node_list, _ = await self.api.list_of(paths.NODES, wire.Node)
        facts = {n.metadata.name: api_devices.node_facts(n) for n in node_list}
        inventory = [api_devices.inventory(d, facts.get(d.metadata.name)) for d in device_list if not d.spec.dra]
        state = fleet.FleetState(inventory)
        ledger = core_ledger.Ledger(state)
        pod_list, _ = await self.api.list_of(paths.PODS, wire.Pod)
        records = [pods.record(p) for p in pod_list]
        ledger.load(
            [r.allocation for r in records if r.allocation is not None and r.live and r.allocation.node == r.node]
        )
        for record in records:  # whole-GPU pods (no allocation annotation) and reservations hold GPUs too
            if record.live and record.allocation is None and record.request is not None and record.request.demand.whole:
                row = state.row(record.node)
                if row is not None:
                    free = np.flatnonzero(state.tenants[row] == 0)[: record.request.demand.count]
                    state.tenants[row, free] += 1
                    state.exclusive[row, free] += 1
                    state.milli_free[row, free] = 0
        placer = core_placer.Placer(state, policies.make("bestfit"))
        stuck: list[str] = []
        waiting: dict[str, list[pods.Record]] = {}
        for record in records:
            pending = record.key.startswith(f"{NS}/") and not record.node and not record.terminal
            if pending and record.gang is not None:
                waiting.setdefault(record.gang.key, []).append(record)
            elif pending and record.request and placer.decide(record.request.demand).status.ok:
                stuck.append(record.key)
        for gang_key, members in waiting.items():  # a gang is stuck only if the whole of what it needs fits
            gang = members[0].gang
            assert gang is not None
            bound = sum(
                1 for r in records if r.gang is not None and r.gang.key == gang_key and r.node and not r.terminal
            )
            need = max(1, gang.min_count - bound)
            asked = [r.request for r in members if r.request is not None]
            if len(asked) >= need and core_gangs.plan(ledger, placer, asked, need).status.ok:
                stuck += [f"gang {gang_key}: {r.key}" for r in members]
        if self.dra:
            stuck += await self.claims_that_fit(device_list, pod_list)
        state_of = frozenset(
            (p.metadata.name, p.metadata.uid, p.spec.node_name or "", p.metadata.deletion_timestamp is not None,
             len(p.spec.scheduling_gates))
            for p in pod_list
        )  # fmt: skip
        return stuck, state_of

    async def claims_that_fit(self, device_list: list[wire.Device], pod_list: list[wire.Pod]) -> list[str]:
        """DRA pods pending although a DRA node's GPU has room for their share after the claims, and
        pods whose claim is allocated but which are not bound."""
        free = {
            (d.metadata.name, g.index): [1000, g.memory_mib] for d in device_list if d.spec.dra for g in d.spec.gpus
        }
        claim_list, _ = await self.api.list_of(dra.CLAIMS, dra.ResourceClaim)
        memory_of = {k: v[1] for k, v in free.items()}
        allocated: set[tuple[str, str]] = set()
        for claim in claim_list:
            held = dra.held(dra.claim_record(claim), memory_of)
            if held is None:
                continue
            allocated.add((claim.metadata.namespace, claim.metadata.name))
            for index, (milli, memory) in held.gpu_usage().items():
                left = free.setdefault((held.node, index), [0, 0])
                left[0] -= milli
                left[1] -= memory
        stuck = []
        for pod in pod_list:
            record = pods.record(pod)
            if not record.key.startswith(f"{NS}/") or record.node or record.terminal or not record.claims:
                continue
            first = record.claims[0]
            shape = dra.template_shape(first.template) if first.template else dra.claim_shape(first.claim)
            if any((NS, ref.claim) in allocated for ref in record.claims):
                stuck.append(f"claim allocated, pod not bound: {record.key}")
            elif shape is not None and any(m >= shape.milli and mib >= shape.memory_mib for m, mib in free.values()):
                stuck.append(f"fits a DRA GPU: {record.key}")
        return stuck

    async def reservations(self) -> dict[tuple[str, int], str]:
        """(node, GPU) -> its live reservation pods and what they reported (for the details)."""
        found, _ = await self.api.list_of(paths.pods(names.HOLDING_NAMESPACE), wire.Pod)
        out: dict[tuple[str, int], list[str]] = {}
        for pod in found:
            record = pods.record(pod)
            slot = record.reservation
            if slot is not None and record.live:
                state = f"{record.phase}, UUID {slot.uuid or 'not reported'}"
                out.setdefault((slot.node, slot.index), []).append(f"{record.key.split('/')[1]}: {state}")
        return {k: "; ".join(v) for k, v in out.items()}

    async def unfilled_handoffs(self) -> tuple[list[str], list[wire.Pod]]:
        """Bound sharing pods whose hand-off ConfigMap does not hold their GPU (the extender claims it
        empty before the bind, and fills it once the GPU's reservation reports) (and the pods, for the
        rest)."""
        maps, _ = await self.api.list_all(paths.configmaps(NS))
        filled = {c["metadata"]["name"] for c in maps if c.get("data")}
        pod_list, _ = await self.api.list_of(paths.pods(NS), wire.Pod)
        held = await self.reservations()
        out = []
        for pod in pod_list:
            record = pods.record(pod)
            alloc = record.allocation
            if (
                record.live
                and record.handoff
                and alloc is not None
                and not alloc.exclusive
                and record.handoff not in filled
            ):
                gpus = ", ".join(f"gpu{i} {held.get((alloc.node, i), 'unheld')}" for i in alloc.gpu_indices)
                out.append(f"hand-off never filled: {record.key} on {alloc.node} ({gpus})")
        return out, pod_list

    async def why_pending(self, stuck: list[str], told: list[Json]) -> dict[str, Json]:
        """For the first stuck pods still pending: what kube-scheduler last wrote of them and their
        newest event, to read after a bad verdict."""
        why: dict[str, Json] = {}
        for key in stuck[:20]:
            namespace, _, name = key.rpartition(" ")[2].partition("/")
            try:
                pod = await self.api.get(paths.pod(namespace, name))
            except kube_errors.NotFoundError:
                continue
            scheduled = [c for c in pod.get("status", {}).get("conditions", []) if c.get("type") == "PodScheduled"]
            events = [e for e in told if e["involvedObject"].get("name") == name]
            newest = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "", default=None)
            why[key] = {
                "gates": [g["name"] for g in pod["spec"].get("schedulingGates", [])],
                "nominated": pod.get("status", {}).get("nominatedNodeName"),
                "scheduled": {k: scheduled[0].get(k) for k in ("status", "reason", "message", "lastTransitionTime")}
                if scheduled
                else None,
                "event": {k: newest.get(k) for k in ("reason", "message", "lastTimestamp", "eventTime", "count")}
                if newest
                else None,
            }
        return why

    async def partial_gangs(self) -> list[str]:
        """Gangs with some, but fewer than their minimum, of their members bound (read after the gangs'
        timeout has passed: a plan is bound whole or given back by then)."""
        bound = await self.bound_names()
        out = []
        for gang, members in sorted(self.gangs.items()):
            count = sum(1 for m in members if m in bound)
            if 0 < count < len(members):
                out.append(f"{gang}: {count} of {len(members)} bound ({', '.join(m for m in members if m in bound)})")
        return out

    async def leaked_gang_plans(self) -> list[str]:
        """Plans kept in the API whose members are all bound, gone or replaced: ended, yet not deleted."""
        kept, _ = await self.api.list_of(
            paths.configmaps(names.SYSTEM_NAMESPACE),
            wire.ConfigMap,
            {"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_GANG_PLAN}"},
        )
        pod_list, _ = await self.api.list_of(paths.pods(NS), wire.Pod)
        return ended_plans(kept, pod_list)

    async def bound_names(self) -> set[str]:
        pod_list, _ = await self.api.list_of(paths.pods(NS), wire.Pod)
        return {p.metadata.name for p in pod_list if p.spec.node_name and not pods.is_terminal(p)}

    async def verdict(self, idle_wait: float) -> dict[str, Any]:
        await self.untaint_all()
        await asyncio.sleep(idle_wait)
        # Pending pods first: kube-scheduler's informers may be backing off after the last fault, and
        # a restarted allocator waits out its fence; what the oracle then reads is the settled state.
        stuck, settled_after = await self.settled_pending()
        found = await self.observe()
        for _ in range(60):  # reservations follow their sharers; give them time to settle
            if found is not None and not (found.leaked_reservations or found.unheld or found.duplicate_reservations):
                break
            await asyncio.sleep(1)
            found = await self.observe()
        assert found is not None
        for _ in range(UNUSED_CLEARED + 30 if self.dra else 0):  # unused allocations are cleared after a while
            if not found.orphan_allocations:
                break
            await asyncio.sleep(1)
            found = await self.observe() or found
        stuck += [f"no valid allocation: {x}" for x in found.missing_allocations]
        unfilled, pod_list = await self.unfilled_handoffs()
        for _ in range(SETTLE):  # the extender's watches may be backing off after the last restart
            if not unfilled:
                break
            await asyncio.sleep(1)
            unfilled, pod_list = await self.unfilled_handoffs()
        stuck += unfilled
        dra_bound = sum(1 for p in pod_list if p.spec.resource_claims and p.spec.node_name and not pods.is_terminal(p))
        if self.dra and dra_bound != found.claims_bound:  # what the oracle could not match, to read after the run
            claim_list, _ = await self.api.list_of(dra.CLAIMS, dra.ResourceClaim)
            where = {
                c.metadata.name: sorted(
                    {r.pool for r in (c.status.allocation.devices.results if c.status.allocation else [])}
                )
                for c in claim_list
            }
            sample = [p for p in pod_list if p.spec.resource_claims and p.spec.node_name][:5]
            print("oracle matched", found.claims_bound, "of", dra_bound, "bound DRA pods; e.g.",
                  [(p.metadata.name, p.spec.node_name, [(r.claim, where.get(r.claim)) for r in pods.record(p).claims])
                   for p in sample], flush=True)  # fmt: skip
        alive = {p.metadata.name for p in pod_list}
        told, _ = await self.api.list_all(paths.events(NS))
        preempted = {e["involvedObject"]["name"] for e in told if e.get("reason") == "Preempted"}
        lost = sorted((self.created - self.deleted - preempted) - alive)
        wrong = sorted(preempted & self.high)
        partial = await self.partial_gangs()
        for _ in range(GANG_TIMEOUT + 10 if partial else 0):  # a plan being bound completes, or is given back
            await asyncio.sleep(1)
            partial = await self.partial_gangs()
            if not partial:
                break
        plans = await self.leaked_gang_plans()
        for _ in range(60 if plans else 0):  # the extender deletes ended plans on its next pass over assumptions
            await asyncio.sleep(1)
            plans = await self.leaked_gang_plans()
            if not plans:
                break
        bound_at_end = await self.bound_names()
        why = await self.why_pending(stuck, told) if stuck else {}
        return {
            "faults_injected": sum(self.faults.values()),
            "overcommits": len(self.overcommits),
            "double_allocations": len(self.doubles),
            "leaked_reservations": len(found.leaked_reservations),
            "leaked_allocations": len(found.orphan_allocations),
            "stuck_pods": len(stuck),
            "lost_pods": len(lost),
            "wrong_preemptions": len(wrong),
            "late_writes_landed": len(self.late_writes_landed),
            "partial_gangs": len(partial),
            "leaked_gang_plans": len(plans),
            "gangs_created": len(self.gangs),
            "gangs_bound_whole": sum(1 for m in self.gangs.values() if set(m) <= bound_at_end),
            "late_write_answers": {str(k): v for k, v in sorted(self.late_answers.items())},
            "preempted": len(preempted),
            "faults": dict(sorted(self.faults.items())),
            "pending_settled_s": round(settled_after),
            "details": {
                "overcommits": sorted(self.overcommits)[:20],
                "double_allocations": sorted(self.doubles)[:20],
                "leaked_reservations": found.leaked_reservations[:20],
                "leaked_allocations": found.orphan_allocations[:20],
                "unheld_shared_gpus": found.unheld[:20],
                "stuck_pods": stuck[:20],
                "why_stuck": why,
                "lost_pods": lost[:20],
                "wrong_preemptions": wrong[:20],
                "late_writes_landed": self.late_writes_landed[:20],
                "partial_gangs": partial[:20],
                "leaked_gang_plans": plans[:20],
            },
            "pods_created": len(self.created),
            "pods_bound_at_end": found.bound + found.claims_bound,
            "dra_pods_created": self.dra_created,
            "dra_pods_bound_at_end": dra_bound,
            "dra_pods_bound_with_their_claim": found.claims_bound,
        }


def ended_plans(kept: list[wire.ConfigMap], pod_list: list[wire.Pod]) -> list[str]:
    """The kept plans with no member left to bind: each one bound, gone, being deleted, ended or
    replaced by a pod of another UID."""
    live = {pods.key(p): p for p in pod_list if not pods.is_terminal(p) and not p.metadata.deletion_timestamp}
    ended = []
    for configmap in kept:
        plan = api_gangs.read_plan(configmap)
        waiting = [
            k for k, (uid, _) in plan.members.items()
            if k in live and live[k].metadata.uid == uid and not live[k].spec.node_name
        ]  # fmt: skip
        if not waiting:
            ended.append(f"{configmap.metadata.name}: gang {plan.gang}, no member left to bind")
    return ended


async def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="sharegpu-chaos-") as tmp:
        chaos = Chaos(Path(tmp), args.nodes, rng, dra=args.dra, log_level=args.log_level, gangs=args.gangs)
        started = time.perf_counter()
        try:
            await chaos.start()
            print(f"stack up with {args.nodes} nodes in {time.perf_counter() - started:.0f} s; churning", flush=True)
            await chaos.churn(args.pods)
            print(f"churn done in {time.perf_counter() - started:.0f} s; checking", flush=True)
            result = await chaos.verdict(idle_wait=10)
        finally:
            await chaos.stop()
            if args.logs is not None:  # every component's log, to read what happened after a bad verdict
                folder = args.logs / f"seed-{seed}"
                folder.mkdir(parents=True, exist_ok=True)
                for log in (Path(tmp) / "logs").glob("*.log"):
                    shutil.copy(log, folder / log.name)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return {"seed": seed, **result}


COUNTS = (
    "overcommits", "double_allocations", "leaked_reservations", "leaked_allocations", "stuck_pods", "lost_pods",
    "wrong_preemptions", "late_writes_landed", "partial_gangs", "leaked_gang_plans",
)  # fmt: skip


def seeds(text: str) -> list[int]:
    """ "1-20", "3", "1,4,7-9" -> the seeds."""
    found: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seeds: {part!r} is not a seed or a range like 1-20") from None
        if high < low:
            raise argparse.ArgumentTypeError(f"--seeds: {part!r} runs backwards")
        found.extend(range(low, high + 1))
    if not found:
        raise argparse.ArgumentTypeError("--seeds: no seed given")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--pods", type=int, default=600)
    parser.add_argument("--seeds", type=seeds, default=[1], help="seeds to run, e.g. 1-20 (default 1)")
    parser.add_argument("--seed", type=int, help="one seed (the same as --seeds N)")
    parser.add_argument("--dra", action="store_true", help="half the nodes serve DRA claims; 40%% of pods ask that way")
    parser.add_argument("--gangs", type=float, default=0.0, help="share of creations that are gangs of 2-4 (e.g. 0.1)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="copy every component's log into DIR/seed-N at the end of each run")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING"],
        help="the extenders' log level (INFO: every binding and claim, to read after a bad verdict)",
    )
    args = parser.parse_args()
    chosen = [args.seed] if args.seed is not None else args.seeds
    runs = []
    for seed in chosen:
        print(f"== seed {seed}", flush=True)
        result = asyncio.run(run(args, seed))
        runs.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "details"}, indent=2), flush=True)
        problems = {k: v for k, v in result["details"].items() if v}
        if problems:
            print("details:", json.dumps(problems, indent=2), flush=True)
        if args.json:  # written after every seed: a long run that is stopped keeps what it found
            args.json.write_text(json.dumps({"runs": runs, "all_zero": all_zero(runs)}, indent=2))
    print(f"{'seed':>5} {'faults':>7} " + " ".join(f"{c:>19}" for c in COUNTS) + f" {'s':>6}")
    for r in runs:
        print(f"{r['seed']:>5} {r['faults_injected']:>7} " + " ".join(f"{r[c]:>19}" for c in COUNTS)
              + f" {r['seconds']:>6}")  # fmt: skip
    print(f"all zero on every seed: {all_zero(runs)}")
    return 0 if all_zero(runs) else 1


def all_zero(runs: list[dict[str, Any]]) -> bool:
    return all(r[c] == 0 for r in runs for c in COUNTS)


if __name__ == "__main__":
    sys.exit(main())
