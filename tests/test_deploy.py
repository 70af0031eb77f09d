"""What deploy/ ships agrees with the names the code uses (one definition, two spellings checked)."""

from __future__ import annotations

from sharegpu.api import names
from sharegpu.devcluster import stack


def test_the_scheduler_leaves_every_sharegpu_resource_to_the_extender() -> None:
    """kube-scheduler filters out every node lacking an extended resource a pod asks for unless the
    extender manages it with ignoredByScheduler: a resource missing here makes every pod that carries
    it unschedulable."""
    (config,) = stack.manifests("files/scheduler/scheduler-config.yaml")
    (extender,) = config["extenders"]
    managed = {m["name"]: m["ignoredByScheduler"] for m in extender["managedResources"]}
    expected = dict.fromkeys((*names.MANAGED_RESOURCES, *names.QUOTA_RESOURCES), True)
    assert managed == {**expected, names.NVIDIA_GPU: False}
