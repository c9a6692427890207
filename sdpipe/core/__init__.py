"""The pure core: the group scheduler, micro-batch schedules, the policies' rules and records, the
run's membership, model cuts and number checks. Standard library and numpy only: no torch, Dask or store.
"""
