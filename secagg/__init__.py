"""Secure aggregation (SecAgg / SecAgg+): the coordinator learns only the weighted sum of masked updates.

Library only: no gRPC here. ``client_protocol.SecAggClient`` and ``server_protocol.SecAggServer`` are the
two state machines; their messages (``messages``) are plain dataclasses of bytes, ints and uint32 arrays.
"""

from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.params import RoundParams

__all__ = ["RoundParams", "SecAggAbort", "SecAggError"]
