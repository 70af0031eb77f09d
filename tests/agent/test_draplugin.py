"""The agent's DRA kubelet plugin, driven as the kubelet drives it: a gRPC client that speaks the
kubelet's published protocols (pluginregistration v1, DRAPlugin v1 and v1beta1) over the plugin's
unix sockets, with claims on the fake API server."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from sharegpu.agent import draplugin
from sharegpu.api import cdi, dra, handoff, names, wire
from sharegpu.kube import client, fake
from tests import builders
from tests.agent.drakubelet import Kubelet

Json = dict[str, Any]
CLAIMS = dra.claim_path("ns")
NODE = "n0"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: a unix socket's path must fit in 108 bytes."""
    made = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def spec() -> wire.DeviceSpec:
    return builders.MakeDevice(NODE).gpus(2, "T4", 16384).wire().spec


def allocated(name: str, node: str = NODE, index: int = 1, milli: int = 300, memory: str = "4Gi") -> Json:
    body = builders.MakeClaim(name).ask(milli, memory).obj()
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": node, "device": dra.device_name(index),
              "shareID": "5e0c1a9e-0000-4000-8000-000000000001",
              "consumedCapacity": {dra.MILLI: str(milli), dra.MEMORY: memory}}  # fmt: skip
    body["status"] = {"allocation": {"devices": {"results": [result]}}}
    return body


class Setup:
    def __init__(self, folder: Path) -> None:
        self.server = fake.FakeApiServer(served=frozenset({dra.API_VERSION}))
        self.api = client.KubeClient(self.server)
        self.paths = draplugin.Paths.under(folder / "plugins", folder / "registry", folder / "cdi")
        self.kubelet = Kubelet(self.paths)
        self.enforce = handoff.Enforcement(hami_core=True)

    def plugin(self) -> draplugin.DraPlugin:
        return draplugin.DraPlugin(self.api, NODE, self.paths, spec, lambda: self.enforce)

    def claim(self, body: Json) -> str:
        uid: str = self.server.put_object(CLAIMS, body)["metadata"]["uid"]
        return uid

    def cdi_file(self, uid: str) -> Path:
        return self.paths.cdi_dir / cdi.file_name(uid)


@pytest.fixture
async def setup(short_dir: Path) -> AsyncIterator[Setup]:
    made = Setup(short_dir)
    yield made
    await made.api.close()


async def test_the_kubelet_learns_what_the_plugin_is_and_tells_it_the_outcome(setup: Setup) -> None:
    plugin = setup.plugin()
    await plugin.start()
    try:
        info = await setup.kubelet.info()
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", dra.DRIVER, str(setup.paths.plugin_socket))
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        said = []
        for registered, error in ((False, "driver name taken"), (True, "")):
            await setup.kubelet.notify(registered, error)
            said.append((plugin.registration.registered, plugin.registration.error))
        assert said == [(False, "driver name taken"), (True, "")]
    finally:
        await plugin.stop()
    assert not setup.paths.registration_socket.exists() and not setup.paths.plugin_socket.exists()


async def test_a_prepared_claim_gets_its_gpu_and_limits_through_cdi_idempotently(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = setup.claim(allocated("c"))
    plugin = setup.plugin()
    moved: list[str] = []
    replace = os.replace

    def seen(source: str, target: Path) -> None:  # the spec is written aside, then moved in whole
        moved.append(Path(source).name)
        replace(source, target)

    monkeypatch.setattr(os, "replace", seen)
    await plugin.start()
    try:
        answer = await setup.kubelet.prepare(("c", uid))
        assert moved and not any(name.endswith((".json", ".yaml")) for name in moved), (
            "a half-written spec is named so that no runtime reads it as one"
        )
        prepared = answer.claims[uid]
        assert prepared.error == ""
        (device,) = prepared.devices
        gpu = spec().gpus[1]
        assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], NODE, "gpu-1")
        assert list(device.cdi_device_ids) == [f"nvidia.com/gpu={gpu.uuid}", f"sharegpu.io/claim={uid}-gpu"]
        assert device.share_id == "5e0c1a9e-0000-4000-8000-000000000001"
        written = orjson.loads(setup.cdi_file(uid).read_bytes())
        assert written["kind"] == "sharegpu.io/claim" and written["cdiVersion"] == cdi.VERSION
        (made,) = written["devices"]
        assert made["name"] == f"{uid}-gpu"
        env = made["containerEdits"]["env"]
        assert f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}" in env
        assert "CUDA_DEVICE_MEMORY_LIMIT=4096m" in env and "CUDA_DEVICE_SM_LIMIT=30" in env
        assert f"LD_PRELOAD={handoff.HAMI_LIBRARY}" in env
        assert made["containerEdits"]["mounts"][0]["hostPath"] == handoff.HAMI_HOST_DIR
        assert oct(setup.cdi_file(uid).stat().st_mode & 0o777) == "0o644"

        again = await setup.kubelet.prepare(("c", uid))
        assert again == answer, "preparing again answers the same"
        older = await setup.kubelet.prepare(("c", uid), version="v1beta1")
        assert list(older.claims[uid].devices[0].cdi_device_ids) == list(device.cdi_device_ids)

        done = await setup.kubelet.unprepare(("c", uid))
        assert done.claims[uid].error == "" and not setup.cdi_file(uid).exists()
        twice = await setup.kubelet.unprepare(("c", uid))
        assert twice.claims[uid].error == "", "unpreparing what is gone is done"
    finally:
        await plugin.stop()


async def test_a_claims_mounts_come_from_the_folders_the_agent_keeps(setup: Setup) -> None:
    """An agent run with --hami-core-dir and --mps-root of its own: the CDI spec mounts those folders
    (it mounted the defaults, where nothing was installed: the preload silently did not load)."""
    mounts = cdi.HostPaths(hami_core="/opt/gpu/hami", mps_root="/opt/gpu/mps")
    setup.paths = dataclasses.replace(setup.paths, mounts=mounts)
    setup.enforce = handoff.Enforcement(hami_core=True, mps=True)
    uid = setup.claim(allocated("c"))
    plugin = setup.plugin()
    await plugin.start()
    try:
        assert (await setup.kubelet.prepare(("c", uid))).claims[uid].error == ""
        (made,) = orjson.loads(setup.cdi_file(uid).read_bytes())["devices"]
        gpu = spec().gpus[1]
        assert sorted(m["hostPath"] for m in made["containerEdits"]["mounts"]) == [
            "/opt/gpu/hami",
            handoff.mps_tenant_folder(gpu.uuid, "/opt/gpu/mps"),
        ]
    finally:
        await plugin.stop()


async def test_a_claim_that_asked_for_compute_only_gets_no_memory_limit(setup: Setup) -> None:
    """No memory asked: the allocation consumes the device's least (1Mi, its request policy), which
    was taken for the claim's limit: HAMi-core held it to 1 MiB (no CUDA context fits) and the
    watchdog judged it against 1 MiB. Like a compute-only pod of the extender path, it has none."""
    body = builders.MakeClaim("c").ask(300).obj()
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": NODE, "device": dra.device_name(1),
              "shareID": "5e0c1a9e-0000-4000-8000-000000000002",
              "consumedCapacity": {dra.MILLI: "300", dra.MEMORY: "1Mi"}}  # fmt: skip
    body["status"] = {"allocation": {"devices": {"results": [result]}}}
    uid = setup.claim(body)
    plugin = setup.plugin()
    await plugin.start()
    try:
        assert (await setup.kubelet.prepare(("c", uid))).claims[uid].error == ""
        (made,) = orjson.loads(setup.cdi_file(uid).read_bytes())["devices"]
        env = made["containerEdits"]["env"]
        assert "CUDA_DEVICE_SM_LIMIT=30" in env and not any(e.startswith("CUDA_DEVICE_MEMORY_LIMIT") for e in env)
        assert plugin.claims is not None and plugin.claims[("ns", "c")].gpus == {spec().gpus[1].uuid: None}
    finally:
        await plugin.stop()


async def test_what_a_restarted_agent_finds_it_unprepares(setup: Setup) -> None:
    uid = setup.claim(allocated("c"))
    first = setup.plugin()
    await first.start()
    await setup.kubelet.prepare(("c", uid))
    await first.stop()
    assert setup.cdi_file(uid).exists(), "a stopped agent leaves running pods their devices"
    second = setup.plugin()
    await second.start()
    try:
        assert second.prepared() == [cdi.file_name(uid)]
        answer = await setup.kubelet.unprepare(("c", uid))
        assert answer.claims[uid].error == "" and not setup.cdi_file(uid).exists()
    finally:
        await second.stop()


async def test_the_plugin_knows_what_each_claim_prepared_here_holds_across_a_restart(setup: Setup) -> None:
    uid = setup.claim(allocated("c"))
    gpu = spec().gpus[1]
    assert setup.plugin().claims is None, "not known before it has read its specs"
    first = setup.plugin()
    await first.start()
    try:
        assert first.claims == {}
        await setup.kubelet.prepare(("c", uid))
        held = cdi.PreparedClaim(namespace="ns", name="c", uid=uid, gpus={gpu.uuid: 4096}, milli={gpu.uuid: 300})
        assert first.claims == {("ns", "c"): held}
        written = orjson.loads(setup.cdi_file(uid).read_bytes())
        assert cdi.PreparedClaim.of_spec(written) == held, "recorded in the spec's annotations"
    finally:
        await first.stop()
    (setup.paths.cdi_dir / cdi.file_name("old")).write_bytes(orjson.dumps({"kind": cdi.KIND, "devices": []}))
    second = setup.plugin()  # an agent that restarts: pods still use the claim
    await second.start()
    try:
        assert second.claims == {("ns", "c"): held}, "read back; a spec that does not say is left out"
        await setup.kubelet.unprepare(("c", uid))
        assert second.claims == {}
    finally:
        await second.stop()


async def test_a_restarted_plugin_removes_the_specs_of_claims_that_are_gone(setup: Setup) -> None:
    kept, gone, renewed = (setup.claim(allocated(name)) for name in ("kept", "gone", "renewed"))
    first = setup.plugin()
    await first.start()
    await setup.kubelet.prepare(("kept", kept), ("gone", gone), ("renewed", renewed))
    await first.stop()
    await setup.api.delete(f"{CLAIMS}/gone")
    await setup.api.delete(f"{CLAIMS}/renewed")
    setup.claim(allocated("renewed"))  # made again: another UID, not the claim that was prepared
    second = setup.plugin()
    await second.start()
    try:
        assert second.claims is not None and sorted(c.name for c in second.claims.values()) == ["kept"]
        assert [setup.cdi_file(u).exists() for u in (kept, gone, renewed)] == [True, False, False]
    finally:
        await second.stop()


@pytest.mark.parametrize("older_sorts_first", [True, False])
async def test_of_two_specs_of_one_claim_name_a_restarted_plugin_keeps_the_live_claims(
    setup: Setup, older_sorts_first: bool
) -> None:
    """The claim is made again (same name, new UID) and prepared before the kubelet unprepared the
    old one; the agent restarts. The spec of the UID the API shows is the claim's, whichever file
    name sorts first (real UIDs are random); the old one's is removed. (A review found the later
    file by name winning, and then removed as stale: the live claim's pods unjudged.)"""
    old = setup.claim(allocated("c", index=0))
    first = setup.plugin()
    await first.start()
    await setup.kubelet.prepare(("c", old))
    await setup.api.delete(f"{CLAIMS}/c")
    if not older_sorts_first:  # the fake numbers its UIDs: the new one then sorts before the old
        setup.server._uids = itertools.count(0)
    new = setup.claim(allocated("c", index=1))
    assert (old < new) is older_sorts_first
    await setup.kubelet.prepare(("c", new))
    await first.stop()
    second = setup.plugin()
    await second.start()
    try:
        assert second.claims is not None and second.claims[("ns", "c")].uid == new
        assert [setup.cdi_file(u).exists() for u in (old, new)] == [False, True]
    finally:
        await second.stop()


async def test_a_claim_prepared_again_never_loses_the_limits_its_spec_was_written_with(setup: Setup) -> None:
    """The kubelet prepares a claim again while HAMi-core is not offered for the moment (its proof
    pending after an agent restart): the spec keeps its preload and limits, so the claim's restarted
    containers do not come back unlimited. A new claim gets what is offered now."""
    uid = setup.claim(allocated("c"))
    plugin = setup.plugin()
    await plugin.start()
    try:
        await setup.kubelet.prepare(("c", uid))

        def env(claim: str) -> list[str]:
            body = orjson.loads(setup.cdi_file(claim).read_bytes())
            return sorted(e for d in body["devices"] for e in d["containerEdits"]["env"])

        limited = env(uid)
        assert f"{handoff.LD_PRELOAD}={handoff.HAMI_LIBRARY}" in limited
        setup.enforce = handoff.Enforcement()
        assert not (await setup.kubelet.prepare(("c", uid))).claims[uid].error
        assert env(uid) == limited
        other = setup.claim(allocated("d"))
        await setup.kubelet.prepare(("d", other))
        assert not any(e.startswith(handoff.LD_PRELOAD) for e in env(other))
    finally:
        await plugin.stop()


async def test_no_spec_is_removed_while_claims_version_is_not_served(setup: Setup) -> None:
    """An agent that restarts while an API server of another version answers (a rollback, a
    mixed-version control plane) reads 404 for every claim: that says nothing of the claims, and
    their specs stay (their pods run on)."""
    uid = setup.claim(allocated("c"))
    first = setup.plugin()
    await first.start()
    await setup.kubelet.prepare(("c", uid))
    await first.stop()
    setup.server.served = frozenset()
    setup.server.remove_object(f"{CLAIMS}/c")  # the 404 such a server answers for the claim
    second = setup.plugin()
    await second.start()
    try:
        assert setup.cdi_file(uid).exists() and second.claims is not None and ("ns", "c") in second.claims
    finally:
        await second.stop()


def test_a_spec_that_says_its_claim_wrongly_says_nothing() -> None:
    for text in ("{", '{"namespace": "n", "name": "c", "uid": "u", "gpus": {"GPU-1": 0}}', "[]"):
        assert cdi.PreparedClaim.of_spec({"annotations": {names.CDI_CLAIM: text}}) is None, text
    assert cdi.PreparedClaim.of_spec({}) is None


async def test_a_claim_that_cannot_be_prepared_is_answered_with_its_reason(setup: Setup) -> None:
    elsewhere = setup.claim(allocated("far", node="n9"))
    bare = setup.claim(builders.MakeClaim("bare").ask(300, "1Gi").obj())
    missing_gpu = setup.claim(allocated("ghost", index=7))
    good = setup.claim(allocated("good"))
    plugin = setup.plugin()
    await plugin.start()
    try:
        answer = await setup.kubelet.prepare(
            ("far", elsewhere), ("bare", bare), ("ghost", missing_gpu), ("good", "not-its-uid"), ("gone", "u9"),
            ("good", good),
        )  # fmt: skip
        errors = {uid: answer.claims[uid].error for uid in answer.claims}
        assert errors[elsewhere] == "claim ns/far is allocated on n9, not on this node n0"
        assert errors[bare] == f"claim ns/bare holds no device of {dra.DRIVER}"
        assert errors[missing_gpu] == "claim ns/ghost: GPU(s) [7] are not on this node"
        assert errors["not-its-uid"] == f"claim ns/good has UID {good}, not the not-its-uid the kubelet names"
        assert errors["u9"] == "claim ns/gone does not exist"
        assert errors[good] == "" and len(answer.claims[good].devices) == 1, "the others do not stop it"
        assert plugin.prepared() == [cdi.file_name(good)]
    finally:
        await plugin.stop()


async def test_a_registration_socket_that_went_is_served_again(setup: Setup) -> None:
    plugin = setup.plugin()
    await plugin.start()
    keeper = asyncio.create_task(plugin.keep(every=0.05))
    try:
        setup.paths.registration_socket.unlink()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if setup.paths.registration_socket.exists():
                break
        info = await setup.kubelet.info()
        assert info.name == dra.DRIVER
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await plugin.stop()


async def test_a_plugin_socket_that_went_is_served_again_and_registered_anew(setup: Setup) -> None:
    """docs/dra.md says the plugin's sockets are served again if they go: the registration socket
    was, but not the plugin's own, so the kubelet's calls failed while /readyz said "registered"."""
    uid = setup.claim(allocated("c"))
    plugin = setup.plugin()
    await plugin.start()
    keeper = asyncio.create_task(plugin.keep(every=0.05))
    try:
        first = os.stat(setup.paths.registration_socket).st_ctime_ns
        setup.paths.plugin_socket.unlink()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if setup.paths.plugin_socket.exists() and os.stat(setup.paths.registration_socket).st_ctime_ns != first:
                break
        assert setup.paths.plugin_socket.exists(), "served again"
        assert os.stat(setup.paths.registration_socket).st_ctime_ns != first, "registered anew: the kubelet dials again"
        assert (await setup.kubelet.prepare(("c", uid))).claims[uid].error == ""
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await plugin.stop()
