"""The node side: the node agent (`sharegpu agent`: `runtime` and what it runs: the Device inventory,
the watchdog, drift repair, MPS daemons, usage reports, the DRA and CSI plugins and their kubelet
registration), the reservation pod's `sharegpu reserve`, the diagnostics tool `sharegpu gpu-check`
(`gpucheck` and its `cuda*` probes), and fakes for nodes and tests without a GPU or a kubelet
(`fakenvml`, `fakekubelet`)."""
