"""The only package that talks to the Kubernetes API: a raw-JSON async client, error translation,
informers (list + watch), and the mapping between Kubernetes objects and sharegpu's domain values."""
