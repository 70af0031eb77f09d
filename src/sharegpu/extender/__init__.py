"""The kube-scheduler extender: filter, prioritize and bind for GPU pods, backed by a cluster cache
rebuilt from the API server, plus the hand-off loop that feeds sharing pods their GPU."""
