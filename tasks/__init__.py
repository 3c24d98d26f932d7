"""fedpar.tasks: running a :class:`fedpar.Task` (loading one by reference, the built-in training loop and
evaluation, a client's share of a dataset) and the built-in tasks of the model zoo (``fedpar.tasks.zoo``)."""

__all__ = ["share_of"]


def __getattr__(name: str):
    # Imported on first use: the command line imports fedpar.tasks.flower_app to build its parsers, without torch.
    if name == "share_of":
        from fedpar.tasks.data import share_of
        return share_of
    raise AttributeError(f"module 'fedpar.tasks' has no attribute {name!r}")
