"""Graph building: the keys, annotations and DAG of each iteration (docs/architecture.md).

:mod:`.structure` is the DAG as plain data (the simulator reads it); :mod:`.build` binds
it to task functions for Dask.
"""
