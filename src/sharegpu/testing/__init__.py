"""Test infrastructure that ships with the package: a real control plane and a fake GPU cluster.

Used by the integration suite and by `sharegpu devcluster`, so anyone can run the whole stack on a
laptop: etcd, kube-apiserver, kube-controller-manager and kube-scheduler (real binaries), fake
nodes, and a harness that plays the kubelet and the NVIDIA device plugin.
"""
