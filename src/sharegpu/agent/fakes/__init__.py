"""Fakes of what a node agent talks to, for nodes and tests without a GPU or a kubelet: NVML from a
file (`nvml`, `sharegpu agent --fake-nvml`) and the kubelet's PodResources API (`kubelet`, tests)."""
