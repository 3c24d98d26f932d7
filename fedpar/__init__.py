"""fedpar: federated learning and centralized training on one torch.distributed engine."""

__version__ = "0.1.0"
