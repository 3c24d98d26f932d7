"""Imported by multiprocessing's fork server alone, the last module it preloads (parallel/init.py
FORK_SERVER_PRELOAD): when its launcher is gone, the server leaves without the interpreter's teardown of torch and
the rest it imported, 0.4-0.5 s of CPU each time (as every fedpar command leaves: cli/leaving.py).

Its exit handler, registered after those of the modules preloaded before it, runs before them: the server holds
nothing they would flush or close (it forks children and hands their pids on). The server's children never run exit
handlers: multiprocessing ends each with ``os._exit``."""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
