"""Node-side parts: the reservation pod's `sharegpu reserve` (and, to come, the node agent)."""
