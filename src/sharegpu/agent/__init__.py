"""The node side. The modules here run on a node: the node agent (`sharegpu agent`: `runtime` and what
it runs: the Device inventory, the watchdog, drift repair, MPS daemons, usage reports, the proof of
isolation modes, the DRA and CSI plugins and their kubelet registration) and the reservation pod's
`sharegpu reserve`. Beside them: `cuda`, the child processes on the driver's libcuda that the proof
and the diagnostics run; `tools`, the diagnostics of `sharegpu gpu-check`; `fakes`, NVML from a file
and the kubelet's PodResources API for nodes and tests without a GPU or a kubelet."""
