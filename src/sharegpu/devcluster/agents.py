"""One node agent per fake node, each on its own fake NVML file, as `sharegpu devcluster` runs them.

The agents run in the devcluster's process (a fake node has no machine of its own), share one API
connection with the agent's own identity and RBAC, and write the nodes' Device resources exactly as
on a real node. Each node's fake NVML file (`<folder>/<node>.yaml`, docs/agent.md) is written from
the node's inventory and can be edited while the cluster runs: a GPU turned unhealthy or removed, an
XID, shows in the Device at the agent's next pass. The nodes offer HAMi-core when a stand-in library
file is given (there is no GPU to limit; the hand-offs then carry HAMi-core's variables, as on a
node that has the library).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.core import devices
from sharegpu.kube import client

log = logging.getLogger(__name__)


class NodeAgents:
    def __init__(self, api: client.KubeApi, folder: Path, options: agent_runtime.Options) -> None:
        self.api = api
        self.folder = folder
        self.options = options
        self.agents: dict[str, agent_runtime.Agent] = {}

    def nvml_file(self, node: str) -> Path:
        return self.folder / f"{node}.yaml"

    async def add(self, nodes: list[devices.NodeInventory]) -> None:
        """Write each node's fake NVML file and start its agent; return once every Device is written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        started = []
        for node in nodes:
            path = self.nvml_file(node.name)
            path.write_text(fakenvml.describe(node))
            agent = agent_runtime.Agent(self.api, node.name, fakenvml.FakeNvml(path).open(), self.options)
            self.agents[node.name] = agent
            started.append(agent)
        await asyncio.gather(*(a.start() for a in started))
        for _ in range(600):
            if all(a.written is not None for a in started):
                return
            await asyncio.sleep(0.1)
        missing = sorted(a.node for a in started if a.written is None)
        log.warning("agents of %s have not written their Device yet", ", ".join(missing[:10]))

    async def stop(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.agents.values()), return_exceptions=True)
        self.agents.clear()
