"""Python ``ssl`` contexts for the bulk data plane, from the same PEM files as the gRPC credentials."""

from __future__ import annotations

import ssl

from fedpar.security.tls import TlsFiles, TlsSetupError, load_ca, load_pair


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """The coordinator's context; with a CA it requires and verifies client certificates (mutual TLS)."""
    load_pair(files, "server")  # the same checks (readable, PEM, key matches certificate) as for gRPC
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files.cert), str(files.key))
    if files.ca is not None:
        load_ca(files.ca)
        ctx.load_verify_locations(cafile=str(files.ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """An agent's context: checks the coordinator against ``files.ca`` and presents the agent's certificate."""
    if files.ca is None:
        raise TlsSetupError("the data plane needs the CA certificate that signed the coordinator's")
    load_ca(files.ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server's chain and host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=str(files.ca))
    if files.cert is not None:
        load_pair(files, "client")
        ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx
