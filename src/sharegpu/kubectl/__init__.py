"""`kubectl sharegpu`: the cluster's GPUs, pending pods, groups and budgets, as sharegpu sees them.

The plugin (console script `kubectl-sharegpu`, which kubectl finds on PATH) reads the cluster from
the API with the project's own client and credentials and computes everything with the code the
components run: the extender's cluster cache and ledger for who holds what (`extender.cache`), its
filter (`core.fit`) and wording (`api.reasons`) for why a pod does not fit, its quota check
(`extender.quotas`). Nothing about placement is decided here.

    app     the command line (typer): options, one-line errors, exit codes
    read    the API reads (async, one list per resource)
    render  views to rich tables, text and JSON (pure)
    views   typed API objects to the views the commands show (pure)
"""
