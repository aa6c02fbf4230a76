"""Checkpoints: the layer-keyed format, its checks, the commit protocol across ranks, resuming an engine."""
