"""A real coordinator whose checkpoint restore waits until the test lets it go (to look at a port while it restores)."""

from __future__ import annotations

import threading

from fedpar.server.coordinator import Coordinator


def held_restore() -> tuple[type[Coordinator], threading.Event, threading.Event]:
    """A Coordinator subclass whose restore sets ``restoring`` and waits for ``release``; (class, release,
    restoring)."""
    release, restoring = threading.Event(), threading.Event()

    class HeldRestore(Coordinator):
        def restore(self):
            restoring.set()
            assert release.wait(30)
            super().restore()

    return HeldRestore, release, restoring
