"""Watching a run: traces, per-step metrics, measured memory, bounded output files, straggler injection."""
