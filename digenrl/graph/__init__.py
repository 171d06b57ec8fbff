"""Graph building: the keys, annotations and DAG of each iteration (DESIGN.md section 4).

:mod:`.structure` is the DAG as plain data (the simulator reads it); :mod:`.build` binds
it to task functions for Dask.
"""
