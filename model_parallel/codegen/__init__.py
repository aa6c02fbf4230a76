"""The code generator: stage modules from a partitioned graph, in memory (`build_stage`) or as a package."""
