"""The only package that talks to the Kubernetes API: an async client over a `Transport` (typed
messages or raw JSON), credentials, error translation, informers (list + watch), leader election,
events, token and access reviews, reconcile loops, and an in-memory fake API server for the unit
tests (`fake`). What Kubernetes objects mean in sharegpu's terms lives in `sharegpu.api`."""
