"""A port held for a listener that starts later (:class:`ReservedPort`)."""

from __future__ import annotations

import socket


class ReservedPort:
    """A free port of ``host`` held for a listener that starts later, maybe more than once (a process about to be
    started, one started again): a socket bound to it with SO_REUSEADDR that never listens. While it is open no other
    bind and no outgoing connection's ephemeral port takes the port; a listener that sets SO_REUSEADDR too (the
    rendezvous store of parallel/rendezvous.py's ``bound_store``, the Prometheus endpoint, gRPC's server) binds it
    all the same. A port merely free a moment ago is taken in between on a busy machine (EADDRINUSE in rank 0 seconds
    later)."""

    def __init__(self, host: str = "127.0.0.1", avoid: range | tuple = ()):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        while True:
            self._socket = socket.socket(family, socket.SOCK_STREAM)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, 0))
            self.port: int = self._socket.getsockname()[1]
            if self.port not in avoid:
                break
            self._socket.close()

    def close(self) -> None:
        """Let the port go (idempotent)."""
        self._socket.close()

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc) -> None:
        self.close()
