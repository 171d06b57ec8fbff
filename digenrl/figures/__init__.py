"""Figures read off a run's records: window metrics and the ideal bound, the
benchmark's variants, how much a run learned, and PNG plots."""
