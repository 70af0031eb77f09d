"""The trace-driven simulator: replays workloads through the placement core on virtual time."""
