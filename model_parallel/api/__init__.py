"""The Python API that wires the workflow together: the job builder (`job.py`) and `PipelineTrainer` (`trainer.py`)."""
