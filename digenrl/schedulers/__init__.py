"""Scheduling: pure policy decisions and the Dask plugin that applies them.

Nothing in this package imports torch or task code, so the simulator can drive the same
policy without Dask or a model.
"""
