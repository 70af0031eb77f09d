"""A whole sharegpu cluster on one machine, no container engine needed: `sharegpu devcluster`.

`controlplane` builds and runs real etcd, kube-apiserver, kube-controller-manager and kube-scheduler
processes; `fakecluster` adds GPU nodes with a harness that plays the kubelet and the NVIDIA device
plugin; `stack` installs sharegpu's manifests and runs its components as their own processes with
their own identities; `faults` injects what real clusters throw. The integration suite, the
benchmarks and newcomers trying sharegpu all use it.
"""
