"""Where the node agent finds and puts things on its node, by default: the kubelet's folders and
socket, the driver's programs and libraries, and sharegpu's own folders (those a container mounts
are named in `api.handoff`). The agent's modules and `sharegpu agent`'s options both take their
defaults from here; it imports nothing heavy, so the CLI shows them without loading the agent."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from sharegpu.api import handoff

KUBELET_PLUGINS_DIR: Final = Path("/var/lib/kubelet/plugins")
"""The kubelet's folder of plugin sockets (DRA and CSI drivers make theirs under it)."""
KUBELET_REGISTRY_DIR: Final = Path("/var/lib/kubelet/plugins_registry")
"""Where the kubelet looks for plugins' registration sockets."""
PODRESOURCES_SOCKET: Final = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
"""The kubelet's PodResources API (`agent.podresources`)."""
CDI_DIR: Final = Path("/var/run/cdi")
"""Where the container runtime reads CDI specifications (the DRA plugin writes them)."""
PROC: Final = Path("/proc")
"""The node's /proc (the agent runs in the host's PID namespace)."""

MPS_BINARY: Final = "nvidia-cuda-mps-control"
"""The driver's MPS control program (found on PATH when not a path)."""
MPS_ROOT: Final = Path(handoff.MPS_HOST_ROOT)
"""The MPS daemons' pipe and log folders, one per GPU (`agent.mps.Layout`)."""
LIBCUDA: Final = "libcuda.so.1"
"""The driver's CUDA library, as the proof's children load it (a soname or a path)."""
PROBE_DIR: Final = Path("/run/sharegpu/probe")
"""The proof of isolation modes' scratch folder (`agent.proof`)."""
HAMI_CORE_LIBRARY: Final = Path("/usr/local/vgpu/libvgpu.so")
"""HAMi-core's library as an operator installs it on the node (`agent.hamicore` copies it)."""
HAMI_CORE_DIR: Final = Path(handoff.HAMI_HOST_DIR)
"""Where the agent puts HAMi-core's library for containers to preload."""
