"""hyperpod-sim: a local SageMaker HyperPod control plane with managed tiered checkpointing."""

__version__ = "0.1.0"
