"""The usage watchdog's decisions: each pod's use of each GPU against its grant, the violations, and
what to do about them pass after pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.agent import watchdog
from sharegpu.agent.cgroups import Owner
from sharegpu.agent.nvml import GpuProcess, Utilization
from sharegpu.agent.watchdog import Action, Kind
from sharegpu.api import cdi, names, wire
from sharegpu.api import usage as api_usage
from sharegpu.core import allocation, errors
from tests import builders

NODE = "n0"
MIB = 16384
DEVICE = wire.DeviceSpec(
    gpus=[wire.GpuSpec(index=i, uuid=f"GPU-{i}", model="NVIDIA A100", memory_mib=MIB) for i in range(3)]
)
SHARE = {names.GPU: "1", names.GPU_MILLI: "300", names.GPU_MEMORY: "4096"}


def grants(*devices: tuple[int, int], container: str = "main", exclusive: bool = False) -> allocation.Allocation:
    """An allocation giving `container` (index, memory MiB) on each GPU listed (300 milli each)."""
    made = builders.MakeAllocation("ns/p", NODE).container(container).exclusive(exclusive)
    for index, mib in devices:
        made.grant(index, 300, mib, container=container)
    return made.obj()


def pod(
    name: str,
    *,
    alloc: allocation.Allocation | str | None = None,
    limits: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    namespace: str = "ns",
) -> wire.Pod:
    """A pod on this node: uid-<name>, its one container limited to `limits`."""
    made = builders.MakePod(name, namespace).uid(f"uid-{name}").labels(labels or {}).annotations(annotations or {})
    if alloc is not None:
        made.allocation(alloc)
    return made.node(NODE).container(limits=limits or {}).wire()


def reservation(slot: int, uuid: str | None) -> wire.Pod:
    return pod(
        f"sharegpu-reserve-{NODE}-{slot}", namespace=names.HOLDING_NAMESPACE,
        labels={names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: NODE, names.LABEL_SLOT: str(slot)},
        annotations={names.GPU_UUID: uuid} if uuid else {}, limits={names.NVIDIA_GPU: "1"},
    )  # fmt: skip


def by_uid(*found: wire.Pod) -> dict[str, wire.Pod]:
    return {p.metadata.uid: p for p in found}


def run(
    processes: Sequence[tuple[int, int, int]],
    owners: Mapping[int, str | Owner | None],
    found: Mapping[str, wire.Pod],
    **options: Any,
) -> watchdog.Assessment:
    """`assess` over (pid, GPU index, MiB) processes; `owners`: pid -> pod name (its UID is uid-<name>),
    an Owner, or None (in no pod)."""

    def owner(pid: int) -> Owner | None:
        value = owners.get(pid)
        return Owner(f"uid-{value}", "c0ffee0000000000") if isinstance(value, str) else value

    listed = [GpuProcess(pid, f"GPU-{gpu}", mib) for pid, gpu, mib in processes]
    return watchdog.assess(listed, owner, found, DEVICE, **options)


def usage(result: watchdog.Assessment, name: str, uuid: str) -> watchdog.Usage:
    return next(u for u in result.usages if u.pod.name == name and u.uuid == uuid)


def total(result: watchdog.Assessment, uuid: str) -> watchdog.GpuTotal:
    return next(g for g in result.gpus if g.uuid == uuid)


# ----------------------------------------------------------------- assess


def test_a_sharing_pod_within_its_memory_does_not_violate() -> None:
    found = by_uid(pod("p", alloc=grants((1, 4096)), limits=SHARE))
    result = run([(10, 1, 3000), (11, 1, 1000)], {10: "p", 11: "p"}, found)
    assert result.usages == (
        watchdog.Usage(
            watchdog.PodRef("ns", "p", "uid-p"), "GPU-1", 1, 4000, 4096, ((10, 3000), (11, 1000)),
            share_milli=300, containers=(api_usage.ContainerUse(name="", used_mib=4000),),
        ),
    )  # fmt: skip
    assert usage(result, "p", "GPU-1").pids == (10, 11)
    assert result.violations == ()
    assert [(g.uuid, g.index, g.used_mib, g.pods_mib) for g in result.gpus] == [
        ("GPU-0", 0, 0, 0), ("GPU-1", 1, 4000, 4000), ("GPU-2", 2, 0, 0)
    ]  # fmt: skip


def test_a_pod_over_its_memory_violates_naming_its_pids_largest_first() -> None:
    found = by_uid(pod("p", alloc=grants((1, 4096)), limits=SHARE))
    result = run([(10, 1, 1024), (11, 1, 3072), (12, 1, 2048)], {10: "p", 11: "p", 12: "p"}, found)
    (violation,) = result.violations
    assert violation.kind is Kind.OVER_MEMORY
    assert (violation.pod.key, violation.uuid, violation.index) == ("ns/p", "GPU-1", 1)
    assert (violation.used_mib, violation.allocated_mib) == (6144, 4096)
    assert violation.pids == (11, 12, 10)
    assert violation.kill == (11,)  # 3072 MiB left of 6144: within the 4096 given
    assert violation.message == "pod ns/p uses 6144 MiB of GPU GPU-1 (index 1); it was allocated 4096 MiB"


def test_killing_takes_as_many_of_the_largest_as_it_needs() -> None:
    found = by_uid(pod("p", alloc=grants((0, 1000)), limits=SHARE))
    result = run([(10, 0, 900), (11, 0, 900), (12, 0, 900)], {10: "p", 11: "p", 12: "p"}, found)
    assert result.violations[0].kill == (10, 11)


def test_slack_lets_a_pod_exceed_its_memory_by_that_much() -> None:
    found = by_uid(pod("p", alloc=grants((0, 4096)), limits=SHARE))
    processes = [(10, 0, 4096 + 300)]
    assert run(processes, {10: "p"}, found, slack_mib=512).violations == ()
    assert run(processes, {10: "p"}, found, slack_mib=200).violations[0].kill == (10,)


def test_two_containers_of_one_pod_on_one_gpu_are_summed() -> None:
    two = builders.MakeAllocation("ns/p", NODE).grant(0, 300, 2048, container="a").grant(0, 200, 1024, container="b")
    found = by_uid(pod("p", alloc=two.obj(), limits=SHARE))
    owners = {10: Owner("uid-p", "aaaaaaaaaaaa"), 11: Owner("uid-p", "bbbbbbbbbbbb")}
    within = run([(10, 0, 2000), (11, 0, 1000)], owners, found)
    assert usage(within, "p", "GPU-0").allocated_mib == 3072 and within.violations == ()
    over = run([(10, 0, 1000), (11, 0, 2500)], owners, found)  # b over its own 1024, the pod over 3072
    assert [(v.used_mib, v.allocated_mib, v.pids) for v in over.violations] == [(3500, 3072, (11, 10))]


def test_a_pod_that_asked_for_no_memory_is_never_over_it() -> None:
    found = by_uid(pod("p", alloc=grants((0, 0)), limits={names.GPU: "1", names.GPU_MILLI: "300"}))
    result = run([(10, 0, MIB)], {10: "p"}, found)
    assert usage(result, "p", "GPU-0").allocated_mib is None and result.violations == ()
    elsewhere = run([(10, 1, 100)], {10: "p"}, found)  # but its grant is still on GPU-0 only
    assert [v.kind for v in elsewhere.violations] == [Kind.UNALLOCATED_GPU]


def test_a_cpu_only_pod_on_a_gpu_uses_a_gpu_it_was_not_given() -> None:
    found = by_uid(pod("q"))
    result = run([(20, 0, 512)], {20: "q"}, found)
    assert usage(result, "q", "GPU-0").allocated_mib == 0
    (violation,) = result.violations
    assert (violation.kind, violation.allocated_mib, violation.pids, violation.kill) == (
        Kind.UNALLOCATED_GPU, 0, (20,), (20,)
    )  # fmt: skip
    assert violation.message == "pod ns/q uses GPU GPU-0 (index 0), which sharegpu did not give it (512 MiB)"


def test_a_sharing_pod_on_another_gpu_than_its_own() -> None:
    found = by_uid(pod("p", alloc=grants((0, 4096)), limits=SHARE))
    result = run([(10, 0, 1000), (10, 2, 700), (11, 2, 300)], {10: "p", 11: "p"}, found)
    assert [(v.kind, v.uuid, v.used_mib, v.pids) for v in result.violations] == [
        (Kind.UNALLOCATED_GPU, "GPU-2", 1000, (10, 11))
    ]
    assert usage(result, "p", "GPU-0").allocated_mib == 4096


def test_an_index_is_the_gpu_its_reservation_pod_holds() -> None:
    """The device plugin chose the reservation's GPU: index 1 of the allocation is GPU-2 here."""
    found = by_uid(pod("p", alloc=grants((1, 4096)), limits=SHARE), reservation(1, "GPU-2"))
    result = run([(10, 2, 4000)], {10: "p"}, found)
    assert usage(result, "p", "GPU-2").allocated_mib == 4096 and result.violations == ()
    on_gpu_1 = run([(10, 1, 4000)], {10: "p"}, found)
    assert [(v.kind, v.uuid) for v in on_gpu_1.violations] == [(Kind.UNALLOCATED_GPU, "GPU-1")]
    unreported = by_uid(pod("p", alloc=grants((1, 4096)), limits=SHARE), reservation(1, None))
    assert run([(10, 1, 4000)], {10: "p"}, unreported).violations == ()  # the Device's GPU 1 meanwhile


def test_reservation_pods_hold_their_whole_gpu() -> None:
    reserve = reservation(0, "GPU-1")
    found = by_uid(reserve)
    uid = reserve.metadata.uid
    result = run([(30, 1, MIB)], {30: Owner(uid, None)}, found)
    assert usage(result, reserve.metadata.name, "GPU-1").allocated_mib == MIB and result.violations == ()
    elsewhere = run([(30, 2, 10)], {30: Owner(uid, None)}, found)
    assert [(v.kind, v.uuid) for v in elsewhere.violations] == [(Kind.UNALLOCATED_GPU, "GPU-2")]


def test_a_whole_gpu_pod_may_use_all_its_memory() -> None:
    whole = grants((0, MIB), exclusive=True)
    found = by_uid(pod("w", alloc=whole, limits={names.NVIDIA_GPU: "1"}))
    result = run([(40, 2, MIB)], {40: "w"}, found)  # the device plugin chose GPU-2: not known here, allowed
    assert usage(result, "w", "GPU-2").allocated_mib == MIB and result.violations == ()
    known = run([(40, 0, MIB), (41, 2, 100)], {40: "w", 41: "w"}, found, assigned={"ns/w": ["GPU-0"]})
    assert usage(known, "w", "GPU-0").allocated_mib == MIB
    assert [(v.kind, v.uuid) for v in known.violations] == [(Kind.UNALLOCATED_GPU, "GPU-2")]


def test_a_device_plugin_pod_without_an_allocation_holds_what_it_was_given() -> None:
    found = by_uid(pod("w", limits={names.NVIDIA_GPU: "2"}, annotations={names.GPU_UUID: "GPU-0,GPU-1"}))
    result = run([(40, 0, MIB), (41, 1, 1), (42, 2, 1)], {40: "w", 41: "w", 42: "w"}, found)
    assert [u.allocated_mib for u in result.usages] == [MIB, MIB, 0]
    assert [v.uuid for v in result.violations] == ["GPU-2"]


GROUP: Final = {names.LABEL_GROUP_NAMESPACE: "team", names.LABEL_GROUP_NAME: "pair"}


def group_holder() -> wire.Pod:
    """The holder pod of SharedDeviceGroup team/pair: 8192 MiB of GPU 0."""
    return pod(
        "holder", namespace=names.HOLDING_NAMESPACE, alloc=grants((0, 8192)), limits=SHARE,
        labels={names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **GROUP},
    )  # fmt: skip


def test_a_group_member_holds_what_the_groups_holder_holds() -> None:
    group, holder = GROUP, group_holder()
    member = pod("m", namespace="team", labels=group)
    known = {("team", "pair"): frozenset({"team"})}
    result = run([(50, 0, 8000), (51, 1, 10)], {50: "m", 51: "m"}, by_uid(holder, member), groups=known)
    assert [(u.uuid, u.allocated_mib) for u in result.usages] == [("GPU-0", 8192), ("GPU-1", 0)]
    assert [v.uuid for v in result.violations] == ["GPU-1"]
    alone = run([(50, 0, 8000), (51, 1, 10)], {50: "m", 51: "m"}, by_uid(member), groups=known)
    assert [u.allocated_mib for u in alone.usages] == [None, None] and alone.violations == ()
    unknown = run([(50, 0, 8000)], {50: "m"}, by_uid(holder, member))
    assert unknown.violations == (), "while the groups are not known yet, members are not judged"


def test_a_pod_labelled_with_a_group_that_does_not_admit_it_is_judged_on_its_own() -> None:
    """A label is anyone's to set (a namespace the webhook skips, a group removed from its members):
    outside the namespaces the group admits, or naming no group, a pod gets nothing of the holder's."""
    group, holder = GROUP, group_holder()
    intruder = pod("m", namespace="elsewhere", labels=group)
    for groups in ({("team", "pair"): frozenset({"team", "friends"})}, {}):
        result = run([(50, 0, 8000)], {50: "m"}, by_uid(holder, intruder), groups=groups)
        assert [(v.kind, v.uuid, v.allocated_mib) for v in result.violations] == [(Kind.UNALLOCATED_GPU, "GPU-0", 0)], (
            groups
        )
    admitted = pod("m", namespace="friends", labels=group)
    result = run([(50, 0, 8000)], {50: "m"}, by_uid(holder, admitted), groups={("team", "pair"): {"team", "friends"}})
    assert result.violations == ()


def test_a_malformed_allocation_is_not_judged() -> None:
    found = by_uid(pod("p", alloc='{"version": 7}', limits=SHARE))
    result = run([(10, 0, MIB)], {10: "p"}, found)
    assert usage(result, "p", "GPU-0").allocated_mib is None and result.violations == ()


def claimed(name: str, *claims: str, template: str = "") -> wire.Pod:
    """A DRA pod on this node using the ResourceClaims `claims` (and, with `template`, one made from a
    template whose claim is not made yet)."""
    made = builders.MakePod(name, "ns").uid(f"uid-{name}").node(NODE).container()
    for index, claim in enumerate(claims):
        made.claim(claim, f"gpu{index}")
    body = made.obj()
    if template:
        body["spec"]["resourceClaims"].append({"name": "made", "resourceClaimTemplateName": template})
    return wire.convert(body, wire.Pod)


def prepared(name: str, **gpus: int | None) -> dict[tuple[str, str], cdi.PreparedClaim]:
    return {("ns", name): cdi.PreparedClaim(namespace="ns", name=name, uid=f"uid-{name}", gpus=gpus)}


def test_a_dra_pod_is_judged_by_the_claims_prepared_for_it() -> None:
    found = by_uid(claimed("p", "c", "d"))
    claims = {**prepared("c", **{"GPU-1": 4096}), **prepared("d", **{"GPU-1": 1024, "GPU-2": None})}
    within = run([(10, 1, 5000), (11, 2, MIB)], {10: "p", 11: "p"}, found, claims=claims)
    assert within.violations == (), "5000 of the 5120 MiB its two claims hold on GPU-1; no limit on GPU-2"
    assert usage(within, "p", "GPU-1").allocated_mib == 5120 and usage(within, "p", "GPU-2").allocated_mib is None
    over = run([(10, 1, 6000), (12, 0, 100)], {10: "p", 12: "p"}, found, claims=claims)
    assert sorted((v.uuid, v.kind.value) for v in over.violations) == [
        ("GPU-0", Kind.UNALLOCATED_GPU.value), ("GPU-1", Kind.OVER_MEMORY.value)
    ]  # fmt: skip


def test_the_pods_that_share_a_claim_are_held_to_it_together() -> None:
    claims = prepared("c", **{"GPU-1": 4096})
    found = by_uid(claimed("a", "c"), claimed("b", "c"))
    within = run([(10, 1, 2000), (20, 1, 2000)], {10: "a", 20: "b"}, found, claims=claims)
    assert within.violations == ()
    # Each within the claim alone, 5000 MiB together: the largest process goes (or its pod).
    over = run([(10, 1, 2000), (11, 1, 500), (20, 1, 2500)], {10: "a", 11: "a", 20: "b"}, found, claims=claims)
    (violation,) = over.violations
    assert (violation.pod.name, violation.kind, violation.kill, violation.allocated_mib) == (
        "b", Kind.OVER_MEMORY, (20,), 4096
    )  # fmt: skip
    assert violation.message == (
        "pods ns/a, ns/b use 5000 MiB of GPU GPU-1 (index 1) together; their claim(s) ns/c hold 4096 MiB"
    )
    # Two containers of one pod share its claim as one: they are the pod's processes, summed as always.
    one = run([(10, 1, 3000), (11, 1, 3000)], {10: "a", 11: "a"}, by_uid(claimed("a", "c")), claims=claims)
    assert [(v.pod.name, v.used_mib, v.allocated_mib) for v in one.violations] == [("a", 6000, 4096)]


def test_pods_linked_through_any_shared_claim_are_one_pool_counting_each_claim_once() -> None:
    claims = {**prepared("c", **{"GPU-1": 4096}), **prepared("d", **{"GPU-1": 2048})}
    found = by_uid(claimed("a", "c", "d"), claimed("b", "c"), claimed("x", "d"))  # a-c-b and a-d-x: one pool
    within = run([(10, 1, 3000), (20, 1, 1500), (30, 1, 1500)], {10: "a", 20: "b", 30: "x"}, found, claims=claims)
    assert within.violations == (), "6000 of the 6144 MiB c and d hold"
    over = run([(10, 1, 3000), (20, 1, 1500), (30, 1, 2000)], {10: "a", 20: "b", 30: "x"}, found, claims=claims)
    assert [(v.pod.name, v.kill, v.allocated_mib) for v in over.violations] == [("a", (10,), 6144)]


def test_a_pod_using_a_claim_not_prepared_here_is_not_judged() -> None:
    claims = prepared("c", **{"GPU-1": 4096})
    for found, known in (
        (claimed("p", "c"), None),  # the node serves no DRA plugin, or has not read its specs yet
        (claimed("p", "other"), claims),  # another driver's claim, or not prepared yet
        (claimed("p", "c", template="t"), claims),  # a claim from a template, not made yet
    ):
        result = run([(10, 0, 9000)], {10: "p"}, by_uid(found), claims=known)
        assert result.violations == () and usage(result, "p", "GPU-0").allocated_mib is None


def test_a_claim_is_promised_once_however_many_pods_use_it() -> None:
    claims = {**prepared("c", **{"GPU-1": 4096}), **prepared("idle", **{"GPU-2": None})}
    found = by_uid(claimed("a", "c"), claimed("b", "c"), pod("p", alloc=grants((1, 1024)), limits=SHARE))
    assert watchdog.promised(found, DEVICE, claims) == {"GPU-0": 0, "GPU-1": 4096 + 1024, "GPU-2": MIB}
    assert watchdog.promised(found, DEVICE) == {"GPU-0": 0, "GPU-1": 1024, "GPU-2": 0}, "unknown claims: not counted"


def test_processes_in_no_pod_count_in_the_gpu_total_only() -> None:
    agent = pod("agent", namespace=names.SYSTEM_NAMESPACE)
    result = run(
        [(1, 0, 300), (2, 0, 200), (3, 1, 100)], {1: None, 2: "agent", 3: None}, by_uid(agent), exempt={"uid-agent"}
    )
    assert result.usages == () and result.violations == ()
    assert [(g.used_mib, g.node_mib, g.pods_mib, g.unknown_mib) for g in result.gpus[:2]] == [
        (500, 500, 0, 0), (100, 100, 0, 0)
    ]  # fmt: skip


def test_processes_of_pods_not_given_are_unknown_and_ignored() -> None:
    result = run([(60, 0, 1000), (61, 7, 50)], {60: "gone", 61: "gone"}, {})
    assert result.usages == () and result.violations == ()
    assert (total(result, "GPU-0").unknown_mib, total(result, "GPU-0").used_mib) == (1000, 1000)
    stray = total(result, "GPU-7")  # a GPU the Device does not list: last, without an index
    assert (stray.index, stray.memory_mib, stray.unknown_mib) == (None, None, 50) and result.gpus[-1] == stray


def test_samples_are_the_gauges_values() -> None:
    found = by_uid(pod("p", alloc=grants((0, 4096)), limits=SHARE), pod("u", alloc=grants((0, 0)), limits=SHARE))
    sampled = [Utilization("GPU-0", 37, ((10, 30), (11, 7))), Utilization("GPU-1", 5, None)]
    result = run([(10, 0, 1000), (11, 0, 500), (1, 1, 64)], {10: "p", 11: "u", 1: None}, found, utilization=sampled)
    samples = {(s.series.name, s.labels): s.value for s in result.samples()}
    assert samples == {
        (watchdog.POD_USED.name, ("ns", "p", "GPU-0")): 1000,
        (watchdog.POD_ALLOCATED.name, ("ns", "p", "GPU-0")): 4096,
        (watchdog.POD_SM.name, ("ns", "p", "GPU-0")): 30,
        (watchdog.POD_SHARE.name, ("ns", "p", "GPU-0")): 300,
        (watchdog.CONTAINER_USED.name, ("ns", "p", "", "GPU-0")): 1000,
        (watchdog.CONTAINER_SM.name, ("ns", "p", "", "GPU-0")): 30,
        (watchdog.POD_USED.name, ("ns", "u", "GPU-0")): 500,  # no memory limit: no allocated gauge
        (watchdog.POD_SM.name, ("ns", "u", "GPU-0")): 7,
        (watchdog.POD_SHARE.name, ("ns", "u", "GPU-0")): 300,
        (watchdog.CONTAINER_USED.name, ("ns", "u", "", "GPU-0")): 500,
        (watchdog.CONTAINER_SM.name, ("ns", "u", "", "GPU-0")): 7,
        (watchdog.GPU_SM.name, ("GPU-1", "1")): 5,
        (watchdog.GPU_USED.name, ("GPU-0", "0")): 1500,
        (watchdog.GPU_SM.name, ("GPU-0", "0")): 37,
        (watchdog.GPU_USED.name, ("GPU-1", "1")): 64,
        (watchdog.GPU_USED.name, ("GPU-2", "2")): 0,
    }
    assert all(len(s.labels) == len(s.series.labels) for s in result.samples())
    assert {s.series for s in result.samples()} <= set(watchdog.SERIES)


# ----------------------------------------------------------------- decide

OVER = by_uid(pod("p", alloc=grants((0, 4096)), limits=SHARE), pod("q"))


def passes(dog: watchdog.Watchdog, action: Action, *states: bool) -> list[list[tuple[Action, bool]]]:
    """`decide` over passes in which pod p is over its memory (True) or within it (False)."""
    out = []
    for over in states:
        result = run([(10, 0, 5000 if over else 4000)], {10: "p"}, OVER)
        out.append([(act.what, act.repeat) for act in dog.decide(result, action)])
    return out


def test_an_ongoing_violation_is_reported_once_and_again_after_it_clears() -> None:
    report = (Action.REPORT, False)
    assert passes(watchdog.Watchdog(), Action.REPORT, True, True, True, True, True, False, True) == [
        [report], [], [], [], [], [], [report]
    ]  # fmt: skip


def test_kill_is_retried_every_retry_after_passes_while_the_violation_lasts() -> None:
    dog = watchdog.Watchdog(retry_after=3)
    kill, again = (Action.KILL, False), (Action.KILL, True)
    assert passes(dog, Action.KILL, True, True, True, True, True, True, True, False, True) == [
        [(Action.REPORT, False), kill], [], [], [again], [], [], [again], [], [(Action.REPORT, False), kill]
    ]  # fmt: skip


def test_kill_names_the_violations_pids_only() -> None:
    dog = watchdog.Watchdog()
    result = run([(10, 0, 3000), (11, 0, 2000), (20, 1, 5), (1, 0, 9000)], {10: "p", 11: "p", 20: "q", 1: None}, OVER)
    acts = dog.decide(result, Action.KILL)
    assert [(a.what, a.violation.pod.name, a.pids, a.pod) for a in acts] == [
        (Action.REPORT, "p", (), None), (Action.KILL, "p", (10,), None),
        (Action.REPORT, "q", (), None), (Action.KILL, "q", (20,), None),
    ]  # fmt: skip


def test_evict_once_per_pod_then_again_only_if_it_is_still_there() -> None:
    dog = watchdog.Watchdog(retry_after=2)
    both = run([(10, 0, 5000), (10, 1, 10)], {10: "p"}, OVER)  # p over on GPU-0 and on GPU-1, not its own
    first = dog.decide(both, Action.EVICT)
    assert [(a.what, a.violation.kind, a.pod) for a in first] == [
        (Action.REPORT, Kind.OVER_MEMORY, None),
        (Action.EVICT, Kind.OVER_MEMORY, watchdog.PodRef("ns", "p", "uid-p")),
        (Action.REPORT, Kind.UNALLOCATED_GPU, None),
    ]
    assert dog.decide(both, Action.EVICT) == []
    third = dog.decide(both, Action.EVICT)  # the eviction did not take (a disruption budget refused it)
    assert [(a.what, a.repeat) for a in third] == [(Action.EVICT, True)]
    gone = run([(10, 0, 5000)], {10: "p"}, by_uid(pod("q")))  # evicted: no longer among the live pods
    assert dog.decide(gone, Action.EVICT) == []


def test_action_parsing() -> None:
    assert [Action.parse(text) for text in ("report", " KILL ", "evict")] == [Action.REPORT, Action.KILL, Action.EVICT]
    with pytest.raises(errors.InvalidInputError) as refused:
        Action.parse("shoot")
    assert str(refused.value) == "--on-violation: unknown action 'shoot' (valid: report, kill, evict)"
    with pytest.raises(errors.InvalidInputError, match="at least 1"):
        watchdog.Watchdog(retry_after=0)


# ----------------------------------------------------------------- properties

PODS = ["a", "b", "c", "d"]


@st.composite
def node_pods(draw: st.DrawFn) -> dict[str, wire.Pod]:
    found = []
    for name in draw(st.lists(st.sampled_from(PODS), unique=True)):
        kind = draw(st.sampled_from(["cpu", "share", "whole"]))
        if kind == "cpu":
            found.append(pod(name))
        elif kind == "share":
            devices = draw(st.dictionaries(st.integers(0, 2), st.sampled_from([0, 512, 2048, 8192]), min_size=1))
            found.append(pod(name, alloc=grants(*devices.items()), limits=SHARE))
        else:
            found.append(pod(name, limits={names.NVIDIA_GPU: "1"}, annotations={names.GPU_UUID: "GPU-1"}))
    return by_uid(*found)


@settings(max_examples=200, deadline=None)
@given(
    found=node_pods(),
    owners=st.dictionaries(st.integers(1, 30), st.none() | st.sampled_from([*PODS, "gone"])),
    processes=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3), st.integers(0, 20000)), max_size=30),
    actions=st.lists(st.sampled_from(list(Action)), min_size=1, max_size=4),
    slack=st.sampled_from([0, 256]),
)
def test_acts_name_only_violating_pods_and_totals_add_up(
    found: dict[str, wire.Pod],
    owners: dict[int, str | None],
    processes: list[tuple[int, int, int]],
    actions: list[Action],
    slack: int,
) -> None:
    dog = watchdog.Watchdog(retry_after=2)
    for action in actions:
        result = run(processes, owners, found, slack_mib=slack)
        for gpu in result.gpus:
            on_it = [mib for _, index, mib in processes if f"GPU-{index}" == gpu.uuid]
            assert gpu.used_mib == sum(on_it) == gpu.pods_mib + gpu.node_mib + gpu.unknown_mib
        assert {g.uuid for g in result.gpus} == {f"GPU-{i}" for i in range(3)} | {f"GPU-{i}" for _, i, _ in processes}
        violating = {(v.pod.uid, v.uuid) for v in result.violations}
        for row in result.usages:
            over = row.allocated_mib == 0 or (
                row.allocated_mib is not None and row.used_mib > row.allocated_mib + slack
            )
            assert over == ((row.pod.uid, row.uuid) in violating)
        for act in dog.decide(result, action):
            v = act.violation
            assert (v.pod.uid, v.uuid) in violating
            mine = {pid for pid, index, _ in processes if f"GPU-{index}" == v.uuid and owners.get(pid) == v.pod.name}
            assert set(act.pids) <= mine
            assert act.pids == () or act.what is Action.KILL
            owners_of_pids = {f"uid-{owners.get(pid)}" for pid in act.pids}
            assert owners_of_pids <= {v.pod.uid} and owners_of_pids <= {w.pod.uid for w in result.violations}


def test_use_is_split_by_container_as_the_kubelet_names_them_and_sm_is_summed_from_process_samples() -> None:
    base = pod("p", alloc=grants((0, 4096)), limits=SHARE)
    status = wire.PodStatus(
        phase="Running",
        container_statuses=[
            wire.ContainerStatus(name="main", container_id="containerd://aaa111"),
            wire.ContainerStatus(name="side", container_id="containerd://bbb222"),
        ],
    )
    found = by_uid(msgspec.structs.replace(base, status=status))
    owners = {10: Owner("uid-p", "aaa111"), 11: Owner("uid-p", "bbb222"), 12: Owner("uid-p", None)}
    sampled = [Utilization("GPU-0", 60, ((10, 40), (11, 15), (99, 5)))]  # pid 99: not the pod's
    (use,) = run([(10, 0, 1000), (11, 0, 300), (12, 0, 50)], owners, found, utilization=sampled).usages
    assert use.sm_percent == 55 and use.share_milli == 300
    assert use.containers == (
        api_usage.ContainerUse(name="", used_mib=50, sm_percent=0),  # the pod's own cgroup: no container
        api_usage.ContainerUse(name="main", used_mib=1000, sm_percent=40),
        api_usage.ContainerUse(name="side", used_mib=300, sm_percent=15),
    )


def test_a_gpu_without_per_process_samples_gives_no_pod_sm_figure() -> None:
    found = by_uid(pod("p", alloc=grants((0, 4096)), limits=SHARE))
    sampled = [Utilization("GPU-0", 80, None)]  # MIG: NVML takes no per-process samples
    result = run([(10, 0, 1000)], {10: "p"}, found, utilization=sampled)
    (use,) = result.usages
    assert use.sm_percent is None and use.containers[0].sm_percent is None
    names_ = {s.series.name for s in result.samples()}
    assert watchdog.POD_SM.name not in names_ and watchdog.CONTAINER_SM.name not in names_
    assert total(result, "GPU-0").sm_percent == 80


def test_a_whole_gpu_pod_has_a_share_of_a_thousand() -> None:
    found = by_uid(pod("w", annotations={names.GPU_UUID: "GPU-2"}, limits={names.NVIDIA_GPU: "1"}))
    (use,) = run([(10, 2, 100)], {10: "w"}, found).usages
    assert use.share_milli == 1000 and use.sm_percent is None


# ----------------------------------------------------------------- found by a review (stop 64)

MIG = "MIG-7f3c0a00-0000-0000-0000-000000000000"


def test_a_sharing_pod_on_a_mig_reservation_is_not_judged() -> None:
    """mig-strategy single: the reservation reports (and the kubelet lists) a MIG device; NVML tells
    the processes by the whole GPU's UUID, so what the pod uses cannot be matched to what it was
    given: not judged (before: UNALLOCATED_GPU, killed under --on-violation kill)."""
    r = reservation(0, MIG)
    sharer = pod("p", alloc=grants((0, 4096)))
    result = run(
        [(7, 0, 1024)], {7: "p"}, by_uid(r, sharer), assigned={f"{names.HOLDING_NAMESPACE}/{r.metadata.name}": {MIG}}
    )
    assert result.violations == ()


def test_a_whole_gpu_pod_given_a_mig_device_is_not_judged() -> None:
    w = pod("w", limits={names.NVIDIA_GPU: "1"})
    result = run([(7, 0, 1024)], {7: "w"}, by_uid(w), assigned={"ns/w": {MIG}})
    assert result.violations == ()


def test_a_whole_gpu_pod_is_promised_the_gpu_the_kubelet_gave_it() -> None:
    """Which GPU the device plugin gave a whole-GPU pod is the kubelet's word: known, only that GPU is
    counted; not known (the kubelet not read), every GPU, as it might be any."""
    whole = by_uid(pod("w", alloc=grants((0, MIB), exclusive=True), limits={names.NVIDIA_GPU: "1"}))
    assert watchdog.promised(whole, DEVICE, assigned={"ns/w": {"GPU-2"}}) == {"GPU-0": 0, "GPU-1": 0, "GPU-2": MIB}
    assert watchdog.promised(whole, DEVICE) == dict.fromkeys(("GPU-0", "GPU-1", "GPU-2"), MIB)


COMPUTE_ONLY = {names.GPU: "1", names.GPU_MILLI: "300"}


def test_pods_that_asked_for_no_memory_share_only_what_no_other_pod_was_given() -> None:
    """A pod that asked for compute only has no fixed amount, but not the memory another pod was given
    on its GPU: under no isolation it could fill the GPU and push a tenant out of memory it holds.
    Together such pods may use what is left; beyond it the largest of them is over."""
    found = by_uid(
        pod("held", alloc=grants((0, 8192)), limits=SHARE),
        pod("free", alloc=grants((0, 0)), limits=COMPUTE_ONLY),
        pod("also", alloc=grants((0, 0)), limits=COMPUTE_ONLY),
    )
    owners = {10: "held", 20: "free", 21: "free", 30: "also"}
    within = run([(10, 0, 1000), (20, 0, 5000), (30, 0, 3000)], owners, found)
    assert within.violations == (), "8000 of the 8192 MiB nobody was given; held's unused grant is its own"
    over = run([(10, 0, 1000), (20, 0, 5000), (21, 0, 2000), (30, 0, 3000)], owners, found)
    (violation,) = over.violations
    assert (violation.pod.name, violation.used_mib, violation.allocated_mib) == ("free", 7000, 8192 - 3000)
    assert violation.kill == (20,) and "no fixed memory" in violation.message
    alone = run([(20, 0, MIB)], {20: "free"}, by_uid(pod("free", alloc=grants((0, 0)), limits=COMPUTE_ONLY)))
    assert alone.violations == (), "with no one given memory there, the whole GPU is its"
