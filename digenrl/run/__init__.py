"""The run: the world checked before any cluster (`world`), the experiment
trackers, cluster start-up, the generic driver and the RL workload it runs."""
