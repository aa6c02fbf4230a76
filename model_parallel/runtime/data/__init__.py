"""Minibatches keyed by step: synthetic data, a user's dataset, named inputs, prefetching."""
