"""fedpar: federated learning and centralized training on one torch.distributed engine."""

from fedpar.ast_lock import serialize_ast_parse
from fedpar.task import ClientData, Deadline, LocalConfig, Partition, Task, TaskError

serialize_ast_parse()  # before any of fedpar's threads start

__version__ = "0.1.0"
__all__ = ["ClientData", "Deadline", "LocalConfig", "Partition", "Task", "TaskError"]
