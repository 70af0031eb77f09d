"""Tools run beside the agent, not by it: `gpucheck`, the diagnostics of `sharegpu gpu-check`."""
