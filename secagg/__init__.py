"""Secure aggregation (SecAgg / SecAgg+): the coordinator learns only the weighted sum of masked updates.

Library only: no gRPC here (``wire`` converts to and from the protobuf carriers). The two state machines
are ``client_protocol.SecAggClient`` and ``server_protocol.SecAggServer``; their messages
(``messages``) are plain dataclasses of bytes, ints and uint32 arrays.

Threat model, as implemented: an honest-but-curious server and clients, of which fewer than the
threshold of any client's share holders collude. Not implemented from the actively secure variant of
Bonawitz et al. (2017): signatures on the advertised keys (agent identity must come from the transport,
e.g. mutual TLS) and the consistency-check round that stops a lying server from telling different
clients different survivor lists. The SecAgg+ graph seed is chosen by the server.
"""

from fedpar.secagg.errors import SecAggAbort, SecAggError
from fedpar.secagg.params import RoundParams

__all__ = ["RoundParams", "SecAggAbort", "SecAggError"]
