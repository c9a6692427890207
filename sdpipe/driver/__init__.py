"""The driver: ``train()``, the ``Run`` handle, launching on a Dask cluster, steering, membership changes,
watching for failures, the result. Runs in the user's process.
"""
