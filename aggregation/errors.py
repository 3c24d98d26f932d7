"""Errors raised by the aggregation package."""


class NoUpdatesError(RuntimeError):
    """Raised by ``Strategy.finish`` when no update was folded into the round."""
