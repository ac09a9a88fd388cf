"""job: a PyTorch batch training job. Config in; TensorBoard logs, checkpoints and metrics out."""

__version__ = "0.1.0"
