"""digenrl: disaggregated reinforcement-learning post-training of diffusion models on Dask."""

__version__ = "0.1.0"
