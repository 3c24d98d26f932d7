"""Where a process group's sockets listen: the rendezvous store on the one address it was given (torch's TCPStore
binds every interface whatever host it is given), and gloo's connections on loopback when every rank is local."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFFLAGS = 0x8913  # Linux: an interface's flags
_IFF_LOOPBACK = 0x8


def bound_store(host: str, port: int, timeout: timedelta, world_size: int | None = None,
                wait_for_workers: bool = False) -> dist.TCPStore:
    """The rendezvous store, served by this process on ``host``:``port`` only (port 0: a free one; ``store.port``
    says which). OSError if ``host`` is not an address of this machine or the port is taken."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        bound = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the socket from here: Python must not close it when the object goes.
    return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=listener.detach())


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (so the ranks meeting there are all on this machine)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def gloo_on_loopback(host: str) -> None:
    """Have gloo listen on loopback when the ranks meet on ``host`` of this machine's loopback (it otherwise listens
    where the machine's hostname resolves, often a network address); a GLOO_SOCKET_IFNAME the user set stays."""
    if os.environ.get(GLOO_INTERFACE_ENV) or not is_loopback(host):
        return
    interface = loopback_interface()
    if interface is not None:
        os.environ[GLOO_INTERFACE_ENV] = interface


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (None if none is found)."""
    names = [name for _, name in socket.if_nameindex()]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                request = struct.pack("16sH", name.encode()[:15], 0)
                flags = struct.unpack("16sH", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request)[:18])[1]
            except OSError:  # not Linux: go by the usual names
                break
            if flags & _IFF_LOOPBACK:
                return name
    return next((name for name in ("lo", "lo0") if name in names), None)
