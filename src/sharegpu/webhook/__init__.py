"""The admission webhook: translate every GPU request format into sharegpu's canonical form, add the
device hand-off, refuse malformed requests with a clear message, and guard what only the system may set."""
