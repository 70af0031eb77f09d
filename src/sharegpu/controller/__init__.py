"""`sharegpu controller`: the reconcilers of sharegpu's own resources (GPU budgets, shared device
groups, idle shares, the defragmenter, and with `--compat` deviceshare.io groups and KubeShare's
SharePods), run by the holder of a Lease (`controller.runtime` says how)."""
