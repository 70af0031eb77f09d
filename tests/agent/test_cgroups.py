"""A host process's pod and container from its cgroup file, for every layout the kubelet makes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.agent import cgroups
from sharegpu.agent.cgroups import Owner

UID = "5f3c9a2e-8d41-4b7a-9c0e-2a6b1d4f8e73"
U_ = UID.replace("-", "_")
STATIC = "9e1a6b0c3f5d47e28a4c1b7d6e0f3a95"  # a static pod's UID: the hash of its manifest
CID = "3b8f0c6d2e9a41f7b5c8d0e6a2f4b9c1d7e3a5f8b0c2d4e6f8a1b3c5d7e9f0a2"
SANDBOX = "a1d4e7f0b3c6d9e2f5a8b1c4d7e0f3a6b9c2d5e8f1a4b7c0d3e6f9a2b5c8d1e4"
NODE = "7c2e5a8b1d4f7a0c3e6b9d2f5a8c1e4b7d0a3f6c9e2b5d8a1f4c7e0b3d6a9f2c"  # a kind node's container
BURSTABLE = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice"
BESTEFFORT = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice"
GUARANTEED = f"/kubepods.slice/kubepods-pod{U_}.slice"
IN_CONTAINER = Owner(UID, CID)
IN_POD = Owner(UID, None)


def v1(path: str, *, elsewhere: str = "/") -> str:
    """A cgroup v1 file: the controllers a container gets carry `path`, the others `elsewhere`."""
    return "\n".join(
        [
            f"12:hugetlb:{path}",
            f"11:memory:{path}",
            f"10:cpu,cpuacct:{path}",
            f"9:pids:{path}",
            f"8:devices:{path}",
            f"7:rdma:{elsewhere}",
            f"6:misc:{elsewhere}",
            f"5:net_cls,net_prio:{path}",
            f"4:blkio:{path}",
            f"3:freezer:{path}",
            f"2:cpuset:{path}",
            f"1:name=systemd:{path}",
            "",
        ]
    )


def v2(path: str) -> str:
    return f"0::{path}\n"


def hybrid(path: str, unified: str) -> str:
    return v1(path) + v2(unified)


CASES = {
    # cgroup v2, systemd driver, each runtime and QoS class.
    "v2 containerd burstable": (v2(f"{BURSTABLE}/cri-containerd-{CID}.scope"), IN_CONTAINER),
    "v2 cri-o besteffort": (v2(f"{BESTEFFORT}/crio-{CID}.scope"), IN_CONTAINER),
    "v2 docker guaranteed": (v2(f"{GUARANTEED}/docker-{CID}.scope"), IN_CONTAINER),
    "v2 static pod": (
        v2(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC}.slice/cri-containerd-{CID}.scope"),
        Owner(STATIC, CID),
    ),
    "v2 short container id": (v2(f"{BURSTABLE}/docker-{CID[:12]}.scope"), Owner(UID, CID[:12])),
    "v2 cri-o conmon is no container": (v2(f"{BURSTABLE}/crio-conmon-{CID}.scope"), None),
    "v2 the pause container is one like the others": (
        v2(f"{BURSTABLE}/cri-containerd-{SANDBOX}.scope"),
        Owner(UID, SANDBOX),
    ),
    "v2 in the pod, in no container": (v2(BURSTABLE), IN_POD),
    "v2 a sub-cgroup of a container": (v2(f"{BURSTABLE}/cri-containerd-{CID}.scope/init"), IN_CONTAINER),
    "v2 deeper sub-cgroups": (v2(f"{GUARANTEED}/crio-{CID}.scope/workers/w0"), IN_CONTAINER),
    # cgroup v1, both drivers; some controllers are not per container.
    "v1 systemd docker": (v1(f"{BURSTABLE}/docker-{CID}.scope"), IN_CONTAINER),
    "v1 systemd cri-o guaranteed": (v1(f"{GUARANTEED}/crio-{CID}.scope"), IN_CONTAINER),
    "v1 cgroupfs burstable": (v1(f"/kubepods/burstable/pod{UID}/{CID}"), IN_CONTAINER),
    "v1 cgroupfs besteffort cri-o": (v1(f"/kubepods/besteffort/pod{UID}/crio-{CID}"), IN_CONTAINER),
    "v1 cgroupfs guaranteed": (v1(f"/kubepods/pod{UID}/{CID}"), IN_CONTAINER),
    "v1 cgroupfs cri-o conmon": (v1(f"/kubepods/pod{UID}/crio-conmon-{CID}"), None),
    "v1 cgroupfs in the pod": (v1(f"/kubepods/besteffort/pod{UID}"), IN_POD),
    "v1 cgroupfs sub-cgroup": (v1(f"/kubepods/burstable/pod{UID}/{CID}/sub"), IN_CONTAINER),
    "v1 name=systemd elsewhere": (
        v1(f"/kubepods/burstable/pod{UID}/{CID}").replace(
            f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}", "1:name=systemd:/system.slice/containerd.service"
        ),
        IN_CONTAINER,
    ),
    "v1 one controller only at the pod": (
        v1(f"{BURSTABLE}/cri-containerd-{CID}.scope").replace(
            f"12:hugetlb:{BURSTABLE}/cri-containerd-{CID}.scope", f"12:hugetlb:{BURSTABLE}"
        ),
        IN_CONTAINER,
    ),
    # Hybrid: v1 controllers and the unified hierarchy, which may or may not carry the pod.
    "hybrid, both carry it": (
        hybrid(f"{BURSTABLE}/cri-containerd-{CID}.scope", f"{BURSTABLE}/cri-containerd-{CID}.scope"),
        IN_CONTAINER,
    ),
    "hybrid, only v1 carries it": (hybrid(f"/kubepods/pod{UID}/{CID}", "/"), IN_CONTAINER),
    # A cgroup namespace of the agent's own: paths outside it climb with `..`, or are relative.
    "namespace, systemd": (
        v2(f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/cri-containerd-{CID}.scope"),
        IN_CONTAINER,
    ),
    "namespace, systemd, same QoS class": (
        v2(f"/../../kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope"),
        IN_CONTAINER,
    ),
    "namespace, cgroupfs above the QoS class": (v2(f"/../../../besteffort/pod{UID}/{CID}"), IN_CONTAINER),
    "namespace, cgroupfs guaranteed": (v2(f"/../../pod{UID}/{CID}"), IN_CONTAINER),
    "relative path": (v2(f"kubepods.slice/kubepods-pod{U_}.slice/docker-{CID}.scope"), IN_CONTAINER),
    # A --cgroup-root, and kubelets nested in a container (kind).
    "cgroupfs under a cgroup root": (v2(f"/custom/kubepods/burstable/pod{UID}/{CID}"), IN_CONTAINER),
    "systemd under a cgroup root": (
        v2(
            f"/system.slice/system-kubepods.slice/system-kubepods-burstable.slice/"
            f"system-kubepods-burstable-pod{U_}.slice/crio-{CID}.scope"
        ),
        IN_CONTAINER,
    ),
    "kind on cgroup v2": (
        v2(
            f"/system.slice/docker-{NODE}.scope/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{U_}.slice/cri-containerd-{CID}.scope"
        ),
        IN_CONTAINER,
    ),
    "kind on cgroup v1": (v1(f"/docker/{NODE}/kubelet/kubepods/burstable/pod{UID}/{CID}"), IN_CONTAINER),
    "a pod of a kubelet running in a pod is the outer pod's": (
        v2(
            f"{BURSTABLE}/cri-containerd-{CID}.scope/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-pod{STATIC}.slice/cri-containerd-{SANDBOX}.scope"
        ),
        IN_CONTAINER,
    ),
    # Not in a pod.
    "a system service": (v2("/system.slice/containerd.service"), None),
    "a login session": (v1("/user.slice/user-1000.slice/session-3.scope"), None),
    "init": (v2("/init.scope"), None),
    "the agent in its own namespace": (v2("/"), None),
    "a sibling of the agent, its pod above the namespace": (v2(f"/../cri-containerd-{CID}.scope"), None),
    "v1 all at the root": (v1("/"), None),
    "a cgroupfs pod not under kubepods": (v2(f"/custom/pod{UID}/{CID}"), None),
    "kubepods itself": (v2("/kubepods.slice/kubepods-burstable.slice"), None),
    # Malformed.
    "empty": ("", None),
    "not a cgroup file": ("hello\n", None),
    "a line without its path field": (f"0:{BURSTABLE}\n", None),
    "a hierarchy that is not a number": (f"x::{BURSTABLE}\n", None),
    "lines naming two pods": (
        v2(f"{BURSTABLE}/cri-containerd-{CID}.scope") + f"1:name=systemd:/kubepods/pod{STATIC}/{CID}\n",
        None,
    ),
    "lines naming two containers": (
        v2(f"{BURSTABLE}/cri-containerd-{CID}.scope") + f"1:name=systemd:{BURSTABLE}/cri-containerd-{SANDBOX}.scope\n",
        None,
    ),
    "a short UID": (v2(f"/kubepods/burstable/pod5f3c9a2e-8d41/{CID}"), None),
    "a systemd UID with dashes": (v2(f"/kubepods.slice/kubepods-pod{UID}.slice/docker-{CID}.scope"), None),
    "a cgroupfs UID with underscores": (v2(f"/kubepods/pod{U_}/{CID}"), None),
    "an upper-case UID": (v2(f"/kubepods/pod{UID.upper()}/{CID}"), None),
    "a short container id": (v2(f"{BURSTABLE}/cri-containerd-{CID[:11]}.scope"), None),
    "an unknown runtime": (v2(f"{BURSTABLE}/runsc-{CID}.scope"), None),
    "a systemd scope under a cgroupfs pod": (v2(f"/kubepods/pod{UID}/docker-{CID}.scope"), None),
    "a bare id under a systemd pod": (v2(f"{BURSTABLE}/{CID}"), None),
}


@pytest.mark.parametrize(("text", "owner"), CASES.values(), ids=CASES.keys())
def test_each_layout_names_its_pod_and_container(text: str, owner: Owner | None) -> None:
    assert cgroups.owner_of(text) == owner


@pytest.mark.parametrize(
    ("value", "bare"),
    [
        (f"containerd://{CID}", CID),
        (f"cri-o://{CID}", CID),
        (f"docker://{CID}", CID),
        (CID, CID),
        ("", ""),  # a container not started yet has none
    ],
)
def test_a_status_container_id_loses_its_scheme(value: str, bare: str) -> None:
    assert cgroups.container_id(value) == bare


def test_a_process_matches_its_container_status_and_the_sandbox_matches_none() -> None:
    statuses = [f"containerd://{CID}", f"containerd://{NODE}"]
    ids = {cgroups.container_id(value) for value in statuses}
    container = cgroups.owner_of(v2(f"{BURSTABLE}/cri-containerd-{CID}.scope"))
    pause = cgroups.owner_of(v2(f"{BURSTABLE}/cri-containerd-{SANDBOX}.scope"))
    assert container is not None and container.container_id in ids
    assert pause is not None and pause.pod_uid == UID and pause.container_id not in ids


# Property tests: any UID and container id, in any layout, comes back exactly.

UIDS = st.uuids().map(str) | st.uuids().map(lambda uuid: uuid.hex)
IDS = st.from_regex(r"[0-9a-f]{12,64}", fullmatch=True)
QOS = st.sampled_from(["", "burstable", "besteffort"])
CGROUP_ROOT = st.sampled_from(["", "kubelet", "custom"])
RUNTIME = st.sampled_from(["cri-containerd", "crio", "docker"])
SUBS = st.lists(st.sampled_from(["init", "sub", "w0", "leaf.scope"]), max_size=3)


def systemd(root: str, qos: str, uid: str, scope: str | None) -> list[str]:
    """The segments of a pod's (or its container's) cgroup with the systemd driver."""
    top = f"{root}-kubepods" if root else "kubepods"
    slices = [f"{root}.slice"] if root else []
    slices.append(f"{top}.slice")
    if qos:
        top = f"{top}-{qos}"
        slices.append(f"{top}.slice")
    slices.append(f"{top}-pod{uid.replace('-', '_')}.slice")
    return slices + ([scope] if scope else [])


def cgroupfs(root: str, qos: str, uid: str, container: str | None) -> list[str]:
    return [part for part in (root, "kubepods", qos, f"pod{uid}", container) if part]


@st.composite
def layouts(draw: st.DrawFn, uid: str, cid: str | None, *, conmon: bool = False) -> str:
    """A cgroup file of a process in pod `uid` (container `cid`) in a layout of hypothesis's choice."""
    root, qos, runtime = draw(CGROUP_ROOT), draw(QOS), draw(RUNTIME)
    if draw(st.booleans()):
        scope = f"crio-conmon-{cid}.scope" if conmon else cid and f"{runtime}-{cid}.scope"
        parts = systemd(root, qos, uid, scope)
    else:
        container = f"crio-conmon-{cid}" if conmon else cid and draw(st.sampled_from(["", "crio-"])) + cid
        parts = cgroupfs(root, qos, uid, container)
    pod = next(at for at, part in enumerate(parts) if uid in part or uid.replace("-", "_") in part)
    # Seen from a cgroup namespace elsewhere: the ancestors the two share are hidden, climbed with `..`.
    hidden = draw(st.integers(0, pod))
    climbs = draw(st.integers(1 if hidden else 0, 3))
    parts = [".."] * climbs + parts[hidden:]
    if cid:
        parts += draw(SUBS)
    path = "/".join(parts) if climbs == 0 and draw(st.booleans()) else "/" + "/".join(parts)
    version = draw(st.sampled_from(["v1", "v2", "hybrid"]))
    if version == "v2":
        return v2(path)
    text = v1(path, elsewhere=draw(st.sampled_from(["/", "/system.slice/containerd.service"])))
    return text + v2(draw(st.sampled_from([path, "/"]))) if version == "hybrid" else text


@settings(max_examples=300, deadline=None)
@given(uid=UIDS, cid=st.none() | IDS, data=st.data())
def test_any_pod_and_container_in_any_layout_come_back_exactly(uid: str, cid: str | None, data: st.DataObject) -> None:
    text = data.draw(layouts(uid, cid))
    assert cgroups.owner_of(text) == Owner(uid, cid)


@settings(max_examples=100, deadline=None)
@given(uid=UIDS, cid=IDS, data=st.data())
def test_cri_o_conmon_is_never_a_container(uid: str, cid: str, data: st.DataObject) -> None:
    assert cgroups.owner_of(data.draw(layouts(uid, cid, conmon=True))) is None


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_any_text_gives_an_owner_or_none(text: str) -> None:
    owner = cgroups.owner_of(text)
    assert owner is None or isinstance(owner, Owner)


PIECES = [
    "0", "12", ":", "::", "/", "..", "\n", "name=systemd", "memory", "kubepods", "kubepods.slice", "burstable",
    "kubepods-burstable.slice", f"kubepods-burstable-pod{U_}.slice", f"kubepods-pod{STATIC}.slice", f"pod{UID}",
    f"cri-containerd-{CID}.scope", f"crio-conmon-{CID}.scope", CID, f"crio-{SANDBOX}", "init", "-", "_", ".slice",
]  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40))
def test_any_mix_of_cgroup_fragments_names_only_pods_and_containers_in_it(pieces: list[str]) -> None:
    owner = cgroups.owner_of("".join(pieces))
    assert owner is None or (owner.pod_uid in {UID, STATIC} and owner.container_id in {CID, SANDBOX, None})


# Reading /proc.


def fake_proc(root: Path, files: dict[int, str]) -> Path:
    for pid, text in files.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root


def test_read_owner_reads_each_process_from_the_proc_tree(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path / "proc",
        {
            4242: v2(f"{BURSTABLE}/cri-containerd-{CID}.scope"),
            4243: v1(f"/kubepods/besteffort/pod{UID}"),
            1: v2("/init.scope"),
            77: "not a cgroup file",
        },
    )
    assert cgroups.read_owner(4242, proc) == IN_CONTAINER
    assert cgroups.read_owner(4243, proc) == IN_POD
    assert cgroups.read_owner(1, proc) is None
    assert cgroups.read_owner(77, proc) is None
    assert cgroups.read_owner(5000, proc) is None  # exited before we looked


def test_a_process_without_a_cgroup_file_or_with_undecodable_bytes_is_nobody(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "10").mkdir(parents=True)  # exited between listing /proc and reading its file
    (proc / "11").mkdir()
    (proc / "11" / "cgroup").write_bytes(b"0::/kubepods/pod\xff\xfe/" + CID.encode() + b"\n")
    assert cgroups.read_owner(10, proc) is None
    assert cgroups.read_owner(11, proc) is None


@pytest.mark.parametrize("error", [ProcessLookupError, FileNotFoundError, PermissionError, OSError])
def test_a_process_that_goes_or_is_not_ours_to_read_is_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[OSError]
) -> None:
    proc = fake_proc(tmp_path / "proc", {4242: v2(f"{BURSTABLE}/cri-containerd-{CID}.scope")})

    def fail(self: Path, *args: object, **kwargs: object) -> str:
        raise error(self)

    monkeypatch.setattr(Path, "read_text", fail)
    assert cgroups.read_owner(4242, proc) is None


def test_the_real_proc_is_read_without_error() -> None:
    if not Path("/proc/self/cgroup").is_file():
        pytest.skip("no /proc here")
    owner = cgroups.read_owner(os.getpid())
    assert owner is None or isinstance(owner, Owner)
