"""The two ways secure aggregation says no."""


class SecAggError(ValueError):
    """A message (or setting) is malformed, out of order or from the wrong party; nothing was changed."""


class SecAggAbort(RuntimeError):
    """The round cannot complete (too many dropouts, inconsistent shares): no sum is revealed."""


class SecAggStageError(SecAggError):
    """A message that is well formed but out of turn: wrong stage, or its sender missed an earlier stage."""
