"""Simulation: the scheduling policy driven without Dask (discrete events), for property
tests, emulated clusters and scale studies."""
