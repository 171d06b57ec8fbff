"""Task functions: what one Dask task computes. Nothing here knows about scheduling."""
