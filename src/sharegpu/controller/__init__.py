"""sharegpu controller: reconcilers of sharegpu's own resources (GPU budgets), with leader election."""
