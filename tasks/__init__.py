"""fedpar.tasks: running a :class:`fedpar.Task` (loading one by reference, the built-in training loop and
evaluation, a client's share of a dataset) and the built-in tasks of the model zoo (``fedpar.tasks.zoo``)."""

from fedpar.tasks.data import share_of

__all__ = ["share_of"]
