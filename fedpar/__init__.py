"""fedpar: federated learning and centralized training on one torch.distributed engine."""

from fedpar.task import ClientData, Deadline, LocalConfig, Partition, Task, TaskError

__version__ = "0.1.0"
__all__ = ["ClientData", "Deadline", "LocalConfig", "Partition", "Task", "TaskError"]
