"""The pipeline runtime: the engine facade over step/, wire/, checkpoint/, build/, observe/, data/ (docs/runtime.md).

At the top only the public face: engine.py (`PipelineEngine`), run.py (`run_job`), config.py (`TrainConfig`,
`RunOptions`), trainer.py (single-process runner and oracle), launch.py, plancheck.py. Submodules import
torch.distributed lazily where they can; import what you need, e.g.
`from model_parallel.runtime.engine import PipelineEngine` and `from model_parallel.runtime.step.schedule import gpipe`.
"""
