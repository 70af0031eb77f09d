"""The group reconciler: binds each SharedDeviceGroup to GPUs of one node and keeps it there.

A group holds its GPUs through a holder pod (`api.groups.holder_pod`), placed by sharegpu like any
GPU pod, so the extender's ledger keeps every other pod off what it holds and no two groups can
hold the same GPU: whole GPUs (`nvidia.com/gpu: N`, whose UUIDs the holder reports), or with
`spec.share` a share of each of N GPUs (sharegpu's resources; the extender writes the holder's
hand-off ConfigMap beside the holder in sharegpu-gpus, which this reconciler follows). The holder is created when
the first member waits (or at once with `bindEagerly`); once it is bound and its GPUs are known,
the group is Bound to that node for good: the node gets the group's label (which the members
select, so they can only run there) and each namespace with members gets the group's hand-off
ConfigMap: NVIDIA_VISIBLE_DEVICES, and for a share its limits. The hand-offs are written before
the node is labelled, and watched: one found written by anyone else (a tenant who made it first
under the group's name, or changed it) is replaced whole, with a Warning event `HandoffForged` on
the group (the chart's admission policy files/policies/handoff.yaml lets only the controller write
them). A holder that is lost is recreated pinned to the group's node; until it reports its GPUs the
group holds none (status `devices` empty, condition reason HolderLost) and the hand-offs are emptied,
so no member starts on GPUs the ledger has freed. A holder made for a placement the group (not bound
yet) no longer has is replaced; once bound, the webhook refuses placement edits. A group not bound
yet takes GPUs only within its namespace's GPU-time budgets: while a used-up Deny or Demote budget
governs that namespace (`api.budgets.holds_back_holder`), no holder is made (one not placed yet is
deleted), and the Bound condition and a Warning event say why (BudgetExhausted).

While members run on a bound group's node, a PodDisruptionBudget beside the holder
(`api.groups.holder_guard`) allows it no eviction: `kubectl drain` evicts the members first, and the
holder once none runs there.

Deletion: the webhook refuses to delete a group with live members; the group's finalizer keeps it
until this reconciler has removed the holder's budget, the holder, the node label and the ConfigMaps.

Everything is derived from the API on every pass (the group's status, the pods labelled with the
group, the node's Device and labels: a label found missing, the node re-registered or the label
removed, is written again), so a new leader simply carries on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal

from sharegpu.api import events as api_events
from sharegpu.api import groups, handoff, names, paths, pods, resources, wire
from sharegpu.controller import inventory
from sharegpu.kube import client, errors, informer, reconcile, takeover
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)
Json = dict[str, Any]


def _group_of(pod: wire.Pod) -> tuple[str, str] | None:
    labels = pod.metadata.labels
    namespace, name = labels.get(names.LABEL_GROUP_NAMESPACE), labels.get(names.LABEL_GROUP_NAME)
    return (namespace, name) if namespace and name else None


def _memory(share: groups.Share) -> str:
    return f"{share.memory_mib} MiB" if share.memory_mib else f"{share.milli / 10:g}% of the memory"


def _unschedulable(pod: wire.Pod) -> str:
    for condition in pod.status.conditions:
        if condition.type == "PodScheduled" and condition.status == "False":
            return condition.message or condition.reason
    return ""


class GroupReconciler:
    def __init__(
        self,
        api: client.KubeApi,
        recorder: kube_events.Recorder,
        clock: Callable[[], float],
        ids: inventory.GpuIds,
        *,
        image: str,
        held_back: Callable[[str], str | None] = lambda namespace: None,
    ) -> None:
        """`held_back`: why a group of that namespace may not take GPUs now (its budgets), or None."""
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.image = image
        self.held_back = held_back
        self.groups: dict[str, groups.SharedDeviceGroup] = {}
        self.pods: dict[str, wire.Pod] = {}
        self.ids = ids
        self.node_labels: dict[str, dict[str, str]] = {}
        """Node -> its labels as the API shows them (watched): a bound group's label is written
        whenever its node lacks it (re-registered, relabelled by hand, cleared by another replica)."""
        self.handoffs: dict[tuple[str, str], wire.ConfigMap] = {}
        """(namespace, ConfigMap) -> the groups' hand-off ConfigMaps as the API shows them (watched)."""
        self.confirmed: dict[tuple[str, str], dict[str, str]] = {}
        """(namespace, ConfigMap) -> what this process last saw right there: a change from it while the
        group's members should still see the same is tampering."""
        self.holder_handoffs: dict[str, dict[str, str]] = {}
        """Share holders' hand-off ConfigMaps (by name, in the holding namespace): what the extender wrote."""
        self.guards: set[str] = set()
        """The holders' PodDisruptionBudgets (by name, in the holding namespace), as watched."""
        self.loop = reconcile.Loop("groups", self.reconcile)

    # ----------------------------------------------------------------- informer handlers

    def on_group(self, kind: wire.EventType, group: groups.SharedDeviceGroup) -> None:
        informer.remember(self.groups, kind, group)
        self.loop.wake()

    def on_pod(self, kind: wire.EventType, pod: wire.Pod) -> None:
        informer.remember(self.pods, kind, pod)
        self.loop.wake()

    def on_node(self, kind: wire.EventType, node: wire.Node) -> None:
        if informer.remember_labels(self.node_labels, kind, node):
            self.loop.wake()

    def on_handoff(self, kind: wire.EventType, configmap: wire.ConfigMap) -> None:
        claim = (configmap.metadata.namespace, configmap.metadata.name)
        if kind == wire.EventType.DELETED:
            self.handoffs.pop(claim, None)
        else:
            self.handoffs[claim] = configmap
        self.loop.wake()

    def on_guard(self, kind: wire.EventType, budget: wire.PodDisruptionBudget) -> None:
        if kind == wire.EventType.DELETED:
            self.guards.discard(budget.metadata.name)
        else:
            self.guards.add(budget.metadata.name)
        self.loop.wake()

    def on_holder_handoff(self, kind: wire.EventType, configmap: wire.ConfigMap) -> None:
        if kind == wire.EventType.DELETED:
            self.holder_handoffs.pop(configmap.metadata.name, None)
        else:
            self.holder_handoffs[configmap.metadata.name] = dict(configmap.data)
        self.loop.wake()

    # ----------------------------------------------------------------- the pass

    def members(self, group: groups.SharedDeviceGroup) -> list[wire.Pod]:
        """The group's live member pods (`api.groups.live_member`)."""
        named = (group.metadata.namespace, group.metadata.name)
        return sorted(
            (
                p
                for p in self.pods.values()
                if _group_of(p) == named
                and groups.live_member(p, group.metadata.namespace, group.spec.members.namespaces)
            ),
            key=lambda p: wire.key(p.metadata),
        )

    def holder(self, namespace: str, name: str) -> wire.Pod | None:
        return self.pods.get(f"{names.HOLDING_NAMESPACE}/{groups.holder_name(namespace, name)}")

    async def reconcile(self) -> None:
        await self.recorder.retell()
        for key, group in list(self.groups.items()):
            try:
                await self._one(group)
            except errors.ConflictError:
                continue  # a newer version is on its way; the next pass works from it
            except errors.NotFoundError as exc:
                own = resources.SHARED_DEVICE_GROUP.path(group.metadata.namespace, group.metadata.name)
                if exc.path in (own, f"{own}/status"):
                    self.groups.pop(key, None)  # deleted meanwhile: its DELETED event is on its way
                else:  # what it writes around it (a node, a ConfigMap, the holder) went: the group stays
                    log.warning("group %s: %s", key, exc)
            except errors.KubeError as exc:
                log.warning("group %s: %s", key, exc)

    async def _one(self, group: groups.SharedDeviceGroup) -> None:
        meta, status = group.metadata, group.status
        members = self.members(group)
        holder = self.holder(meta.namespace, meta.name)
        if meta.deletion_timestamp is not None:
            if not members:
                await self._clean_up(group, holder)
            return
        if names.GROUP_FINALIZER not in meta.finalizers:
            await self.api.patch(
                resources.SHARED_DEVICE_GROUP.path(meta.namespace, meta.name),
                {"metadata": {"finalizers": [*meta.finalizers, names.GROUP_FINALIZER],
                              "resourceVersion": meta.resource_version}},
            )  # fmt: skip
            return
        bound = status.node_name
        placed_for = "" if holder is None else holder.metadata.annotations.get(names.GROUP_PLACEMENT)
        if holder is not None and (
            pods.is_terminal(holder)
            or holder.metadata.deletion_timestamp is not None
            or (not bound and placed_for != groups.placement_digest(group.spec))
        ):  # ended, or made for a placement the group (not bound yet) no longer has: replaced
            if holder.metadata.deletion_timestamp is None:
                await self.api.delete(paths.pod(names.HOLDING_NAMESPACE, holder.metadata.name), grace_period=0)
            holder = None
        # A group not bound yet takes GPUs only within its namespace's budgets: its holder is not made
        # (one not placed yet is taken back) while a used-up budget refuses it. A bound group keeps them.
        refused = None if bound else self.held_back(meta.namespace)
        wanted = bool(bound or group.spec.bind_eagerly or members)  # a holder is wanted now
        if refused is not None and holder is not None and not holder.spec.node_name:
            if holder.metadata.deletion_timestamp is None:
                await self.api.delete(paths.pod(names.HOLDING_NAMESPACE, holder.metadata.name), grace_period=0)
            holder = None
        if holder is None and refused is None and wanted:
            await self._create_holder(group, bound)
        new = self._status(group, holder, members, refused)
        if new.phase == groups.PHASE_BOUND:
            data = self._member_data(group, holder, new)
            # Only namespaces the group admits have members and get its devices (a pod admitted before
            # the webhook knew the group cannot borrow them from a namespace the group does not list).
            # The hand-offs first, the node label (which lets members be scheduled) after.
            for namespace in sorted({meta.namespace} | {p.metadata.namespace for p in members}):
                await self._write_handoff(group, namespace, data)
            await self._label_node(new.node_name, groups.node_label(meta.namespace, meta.name))
        # While members run on its node, its holder may not be evicted (a drain waits for them first).
        running = bool(new.node_name) and any(p.spec.node_name == new.node_name for p in members)
        await self._guard(meta.namespace, meta.name, running)
        if new != status:
            await self._write_status(group, new)
        devices = ", ".join(f"{d.index} ({d.uuid})" for d in new.devices)
        if new.phase == groups.PHASE_BOUND and not bound:
            await self._record(group, "Bound", f"bound to node {new.node_name}, GPUs {devices}",
                               decision=f"{new.node_name}:{devices}")  # fmt: skip
        elif bound and status.devices and not new.devices:
            held = ", ".join(f"{d.index} ({d.uuid})" for d in status.devices)
            await self._record(group, "HolderLost", f"the holder pod of GPUs {held} is gone: a new one is placed on "
                               f"{bound}; members started from now on wait for its GPUs",
                               decision=f"lost:{bound}:{held}", kind="Warning")  # fmt: skip
        elif bound and new.devices and not status.devices:
            await self._record(group, "Bound", f"held again on node {bound}, GPUs {devices}",
                               decision=f"{bound}:{devices}")  # fmt: skip
        elif refused is not None and wanted:
            await self._record(group, "BudgetExhausted", refused, decision=refused, kind="Warning")

    def _status(
        self, group: groups.SharedDeviceGroup, holder: wire.Pod | None, members: list[wire.Pod], refused: str | None
    ) -> groups.GroupStatus:
        """Bound once the holder reports its GPUs, to that node for good; `devices` are what the holder
        holds now: none while a lost holder is replaced (the members' hand-offs are withheld meanwhile).
        `refused`: why no holder is made (a used-up budget)."""
        old = group.status
        node, devices = old.node_name, self._held(group, holder)
        reason, message = "", ""
        if devices:
            node = holder.spec.node_name if holder is not None else node
            share = group.spec.share
            held = "" if share is None else f"{share.milli} milli-GPU and {_memory(share)} of each of "
            reason, message = "Bound", f"holds {held}{len(devices)} GPU(s) of {node}"
        elif node:
            reason, message = (
                "HolderLost",
                (
                    f"its holder pod is gone or not on its GPUs yet; a new one is placed on {node} and members "
                    "started from now on wait for its GPUs"
                ),
            )
        elif refused is not None and holder is None:
            reason, message = "BudgetExhausted", refused
        elif holder is not None and holder.spec.node_name:
            reason, message = "Starting", f"the holder pod is on {holder.spec.node_name}, waiting for its GPUs"
        elif holder is not None:
            reason, message = "Unschedulable", _unschedulable(holder) or "the holder pod waits to be scheduled"
        else:
            reason, message = "NoMembers", "binds when its first member is created (or set bindEagerly)"
        stamp = wire.timestamp(self.clock())
        value: Literal["True", "False"] = "True" if devices else "False"
        before = next((c for c in old.conditions if c.type == "Bound"), None)
        since = before.last_transition_time if before is not None and before.status == value else stamp
        condition = groups.Condition(
            type="Bound", status=value, reason=reason, message=message, last_transition_time=since,
            observed_generation=group.metadata.generation,
        )  # fmt: skip
        return groups.GroupStatus(
            phase=groups.PHASE_BOUND if node else groups.PHASE_PENDING,
            node_name=node,
            devices=devices,
            member_pods=[wire.key(p.metadata) for p in members],
            conditions=[condition],
            observed_generation=group.metadata.generation,
        )

    def _held(self, group: groups.SharedDeviceGroup, holder: wire.Pod | None) -> list[groups.GroupDevice]:
        """The GPUs the holder holds: all `spec.gpus` reported and known on its node (on the group's
        node, for a bound group); none otherwise."""
        bound = group.status.node_name
        if holder is None or not holder.spec.node_name or (bound and holder.spec.node_name != bound):
            return []
        reported = [u for u in self._reported(group, holder).split(",") if u]
        indexes = self.ids.indexes(holder.spec.node_name)
        if len(reported) != group.spec.gpus or not all(u in indexes for u in reported):
            return []
        return sorted((groups.GroupDevice(index=indexes[u], uuid=u) for u in reported), key=lambda d: d.index)

    def _share_handoff(self, holder: wire.Pod | None) -> dict[str, str] | None:
        """A share holder's hand-off as its members read it (`api.groups.member_handoff`); None
        until the extender has written it."""
        if holder is None:
            return None
        return groups.member_handoff(self.holder_handoffs.get(holder.metadata.annotations.get(names.HANDOFF, ""), {}))

    def _reported(self, group: groups.SharedDeviceGroup, holder: wire.Pod) -> str:
        """The UUIDs the holder's GPUs have: reported by the holder itself (whole GPUs), or written
        into its hand-off by the extender (a share)."""
        if group.spec.share is None:
            return holder.metadata.annotations.get(names.GPU_UUID, "")
        return (self._share_handoff(holder) or {}).get(groups.VISIBLE_DEVICES, "")

    def _member_data(
        self, group: groups.SharedDeviceGroup, holder: wire.Pod | None, status: groups.GroupStatus
    ) -> dict[str, str]:
        """What the group's hand-off ConfigMaps hold: the devices the holder holds (and a share's
        limits); nothing while it holds none (a lost holder being replaced: the GPUs members had are
        free in the ledger, so a member starting now waits, NVIDIA_VISIBLE_DEVICES being required)."""
        if not status.devices:
            return {}
        if group.spec.share is None:
            return {groups.VISIBLE_DEVICES: ",".join(d.uuid for d in status.devices)}
        return self._share_handoff(holder) or {}

    # ----------------------------------------------------------------- writes

    async def _create_holder(self, group: groups.SharedDeviceGroup, node: str) -> None:
        body = groups.holder_pod(group, self.image, node)
        try:
            await self.api.create(paths.pods(names.HOLDING_NAMESPACE), body)
        except errors.ConflictError as exc:
            if not exc.already_exists:
                raise

    async def _guard(self, namespace: str, name: str, wanted: bool) -> None:
        """The holder's PodDisruptionBudget there exactly while `wanted`."""
        guard = groups.holder_name(namespace, name)
        if wanted and guard not in self.guards:
            try:
                await self.api.create(paths.pod_disruption_budgets(names.HOLDING_NAMESPACE),
                                      groups.holder_guard(namespace, name))  # fmt: skip
            except errors.ConflictError as exc:
                if not exc.already_exists:
                    raise
            self.guards.add(guard)
        elif not wanted and guard in self.guards:
            await self.api.delete(paths.pod_disruption_budget(names.HOLDING_NAMESPACE, guard))
            self.guards.discard(guard)

    async def _label_node(self, node: str, label: str) -> None:
        if self.node_labels.get(node, {}).get(label) == groups.BOUND:
            return
        await self.api.patch(paths.node(node), {"metadata": {"labels": {label: groups.BOUND}}})

    async def _write_handoff(self, group: groups.SharedDeviceGroup, namespace: str, data: dict[str, str]) -> None:
        """The group's hand-off in `namespace` holds `data` and nothing else: written whole, and taken
        back whole (with an alarm) from anyone else who wrote it."""
        meta = group.metadata
        name = groups.handoff_name(meta.namespace, meta.name)
        claim = (namespace, name)
        labels = {names.LABEL_ROLE: names.ROLE_GROUP_HANDOFF, **groups.group_labels(meta.namespace, meta.name)}
        existing = self.handoffs.get(claim)
        if existing is not None and dict(existing.data) == data and existing.metadata.labels == labels:
            self.confirmed[claim] = dict(data)
            return
        body: Json = {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": data}  # fmt: skip
        path = paths.configmap(namespace, name)
        if existing is not None:
            if self.confirmed.get(claim) == data:
                await self._alarm(group, namespace, name, "was changed after sharegpu wrote it")
            version = existing.metadata.resource_version
            await self.api.replace(path, {**body, "metadata": {**body["metadata"], "resourceVersion": version}})
        else:
            try:
                await self.api.create(paths.configmaps(namespace), body)
            except errors.ConflictError as exc:
                if not exc.already_exists:
                    raise
                found = await self.api.get(path)
                if (found.get("metadata") or {}).get("labels") != labels:
                    await self._alarm(group, namespace, name, "was written by someone other than sharegpu")
                await takeover.overwrite(self.api, paths.configmaps(namespace), path, body, found)
        self.confirmed[claim] = dict(data)

    async def _alarm(self, group: groups.SharedDeviceGroup, namespace: str, name: str, what: str) -> None:
        message = (f"hand-off ConfigMap {namespace}/{name} {what}; sharegpu replaces it with the group's devices "
                   "(check who can write ConfigMaps there, and that the admission policy sharegpu-handoff is "
                   "installed)")  # fmt: skip
        log.error("group %s: %s", wire.key(group.metadata), message)
        await self._record(group, handoff.FORGED_REASON, message, decision=f"{namespace}/{name}:{what}",
                           kind="Warning")  # fmt: skip

    async def _write_status(self, group: groups.SharedDeviceGroup, status: groups.GroupStatus) -> None:
        meta = group.metadata
        stored = await self.api.replace(*resources.SHARED_DEVICE_GROUP.status_update(meta, group.spec, status))
        self.groups[wire.key(meta)] = wire.convert(stored, groups.SharedDeviceGroup)

    async def _clean_up(self, group: groups.SharedDeviceGroup, holder: wire.Pod | None) -> None:
        meta = group.metadata
        await self._guard(meta.namespace, meta.name, False)
        if holder is not None:
            await self.api.delete(paths.pod(names.HOLDING_NAMESPACE, holder.metadata.name), grace_period=0)
        label = groups.node_label(meta.namespace, meta.name)
        if group.status.node_name:
            with contextlib.suppress(errors.NotFoundError):  # the node is gone: so is its label
                await self.api.patch(paths.node(group.status.node_name), {"metadata": {"labels": {label: None}}})
        found = await self.api.get(paths.CONFIGMAPS, labelSelector=groups.group_selector(meta.namespace, meta.name))
        for item in found.get("items") or []:
            item_meta = item["metadata"]
            await self.api.delete(paths.configmap(item_meta["namespace"], item_meta["name"]))
            self.handoffs.pop((item_meta["namespace"], item_meta["name"]), None)
            self.confirmed.pop((item_meta["namespace"], item_meta["name"]), None)
        await self.api.patch(
            resources.SHARED_DEVICE_GROUP.path(meta.namespace, meta.name),
            {"metadata": {"finalizers": [f for f in meta.finalizers if f != names.GROUP_FINALIZER],
                          "resourceVersion": meta.resource_version}},
        )  # fmt: skip
        await self._record(group, "Released", "holder pod, node label and hand-off ConfigMaps removed",
                           decision="released")  # fmt: skip

    async def _record(
        self, group: groups.SharedDeviceGroup, reason: str, message: str, *, decision: str,
        kind: api_events.Kind = "Normal",
    ) -> None:  # fmt: skip
        subject = resources.SHARED_DEVICE_GROUP.subject(group.metadata)
        await self.recorder.tell(subject, reason, message, decision=decision, kind=kind)
