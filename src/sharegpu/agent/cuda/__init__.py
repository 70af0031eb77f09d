"""Child processes on the driver's libcuda (stdlib and ctypes only, so they start fast and load no
CUDA toolkit): `child` holds and probes GPU memory, `probe` runs it in an isolation mode's
environment and judges what it saw (the agent's proof, `agent.proof`, and `sharegpu gpu-check`),
`burn` keeps the SMs busy (gpu-check's compute checks)."""
