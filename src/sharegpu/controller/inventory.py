"""The GPUs' UUIDs per node, from the Device resources: one copy that the group reconciler (which
maps a holder's reported UUIDs to indexes) and the SharePod reconciler (which shows a Pod's GPU
indexes as UUIDs) both read. Updated by the controller's Device informer, in the event loop."""

from __future__ import annotations

from sharegpu.api import wire


class GpuIds:
    def __init__(self) -> None:
        self.by_node: dict[str, dict[int, str]] = {}
        """node -> GPU index -> UUID (GPUs whose UUID is known)."""

    def on_device(self, kind: wire.EventType, device: wire.Device) -> None:
        if kind == wire.EventType.DELETED:
            self.by_node.pop(device.metadata.name, None)
        else:
            self.by_node[device.metadata.name] = {g.index: str(g.uuid) for g in device.spec.gpus if g.uuid}

    def uuid(self, node: str, index: int) -> str | None:
        return self.by_node.get(node, {}).get(index)

    def indexes(self, node: str) -> dict[str, int]:
        """UUID -> index of the node's GPUs."""
        return {uuid: index for index, uuid in self.by_node.get(node, {}).items()}
