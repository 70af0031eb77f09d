"""The node agent on the real API server, with its own least RBAC (deploy/rbac/agent.yaml) and a
fake NVML: the Device appears owned by its Node, follows an XID, and the node gets its GPU labels."""

from __future__ import annotations

import uuid
from pathlib import Path

from sharegpu.agent import fakenvml, inventory
from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import paths, wire
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from tests.agent.test_inventory import FILE, write
from tests.integration.conftest import get_or_none, wait_for


async def test_the_agent_publishes_its_nodes_device_and_follows_an_xid(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, tmp_path: Path
) -> None:
    name = f"agent-{uuid.uuid4().hex[:8]}"
    node = await admin.create(paths.NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    path = tmp_path / "nvml.yaml"
    write(path, FILE)
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    agent = agent_runtime.Agent(kube, name, fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=0.5))
    await agent.start()
    try:

        async def published() -> wire.Device | None:
            found = await get_or_none(admin, paths.device(name))
            return wire.convert(found, wire.Device) if found is not None else None

        device = await wait_for(published, what="the Device")
        assert [g.uuid for g in device.spec.gpus] == ["GPU-0", "GPU-1", "GPU-2"]
        assert device.metadata.owner_references[0].uid == node["metadata"]["uid"]
        labels = (await admin.get(paths.node(name)))["metadata"]["labels"]
        assert labels[inventory.COUNT_LABEL] == "3"

        write(path, FILE + "xids: [{gpu: 1, code: 79}]\n")

        async def marked() -> bool:
            found = await published()
            return found is not None and not found.spec.gpus[1].healthy and found.spec.gpus[1].reason == "XID 79"

        await wait_for(marked, what="GPU 1 marked unhealthy")
    finally:
        await agent.stop()
        await kube.close()
        await admin.delete(paths.device(name))
        await admin.delete(paths.node(name))
