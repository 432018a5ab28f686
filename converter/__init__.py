"""ckptconv: offline, model-free conversion of PyTorch Distributed Checkpoints."""

__version__ = "0.1.0"
