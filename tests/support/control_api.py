"""A service's control API on 127.0.0.1 over an empty run store (nothing executes its runs), for the tests of
`fedpar run` against it: real gRPC over mutual TLS with certificates from `fedpar certs`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from fedpar.security.certs import ensure_certs
from fedpar.security.tls import server_credentials, server_tls_files
from fedpar.server.run_control import RunControlServer
from fedpar.server.run_store import RunStore


@contextlib.contextmanager
def control_api(tmp_path: Path) -> Iterator[tuple[RunStore, tuple[str, ...], Path, int]]:
    """The store, the options that reach the API as operator 'op', the certificates' folder and the API's port."""
    certs = tmp_path / "certs"
    ensure_certs(certs, operators=["op"])
    store = RunStore(tmp_path / "state.db")
    server = RunControlServer(store, lambda settings: (settings, ""), "127.0.0.1", 0,
                              server_credentials(server_tls_files(certs)))
    try:
        yield store, ("--control", f"127.0.0.1:{server.port}", "--certs", str(certs), "--operator", "op"), certs, \
            server.port
    finally:
        server.stop(0)
        store.close()
