"""A pipeline-stage worker: its loop, step boundaries, a stage's compute, the links to its neighbours and the
synchronization policies (``sync``). Runs in a Dask worker process; never imports the driver.
"""
