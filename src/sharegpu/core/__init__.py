"""The placement core: domain values, the ledger, filter, policies and the placer. No I/O."""
