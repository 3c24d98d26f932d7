"""A training step of fixed tensors recorded as a CUDA graph and replayed: a stack of small members' step is
launch-bound on a GPU (the FedAvg paper's round on an H200: about 4 ms a step, nearly all of it Python and kernel
launches for a few microseconds of arithmetic each), and a replay launches the whole step at once."""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Eager steps before the recording: the first ones let cuBLAS and cuDNN pick their kernels and the caching allocator
# settle; the last runs on a side stream, as torch.cuda.graph asks of the work it records.
EAGER_STEPS = 2
# Failed recordings in a row after which a model's steps stay eager for its life (its step does something a recording
# cannot hold, an operation that waits for the host, say). Before that, the next step records again: one can fail
# once and not again ("operation failed due to a previous error during capture" in 5 simulations of the suite on an H200
# busy with 14 test workers, 2026-11-29; none in 10 simulations on the idle box), and that left the model eager.
GIVE_UP_AFTER = 3


class Recordings:
    """Each model's failed recordings in a row, and whether its steps may still be recorded."""

    def __init__(self, give_up_after: int = GIVE_UP_AFTER):
        self.give_up_after = give_up_after
        self._failed: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    def recordable(self, owner: object) -> bool:
        """False once ``owner``'s step failed to record give_up_after times in a row."""
        return self._failed.get(owner, 0) < self.give_up_after

    def succeeded(self, owner: object) -> None:
        """A recording of ``owner``'s step went through: its failures so far were passing ones."""
        self._failed.pop(owner, None)

    def failed(self, owner: object, reason: str) -> None:
        """A recording of ``owner``'s step failed for ``reason``: said at info level while it will be tried again,
        as a warning (once) when its steps stay eager from now on."""
        failures = self._failed[owner] = self._failed.get(owner, 0) + 1
        if failures < self.give_up_after:
            log.info("client batching: a step could not be recorded as a CUDA graph (%s); it runs eagerly, and the "
                     "next step tries again", reason)
        elif failures == self.give_up_after:
            log.warning("client batching: this model's step could not be recorded as a CUDA graph %d times in a row "
                        "(%s); it runs eagerly, one kernel launch at a time", failures, reason)


_recordings = Recordings()


def recordable(owner: object) -> bool:
    """False once a step of ``owner`` (a model) failed to record :data:`GIVE_UP_AFTER` times in a row."""
    return _recordings.recordable(owner)


class GraphedSteps:
    """``body()``, one step that reads and writes only tensors that outlive it (the same memory every step), run
    eagerly :data:`EAGER_STEPS` times, then recorded once on ``device`` (where its tensors are) and replayed."""

    def __init__(self, body: Callable[[], None], owner: object, device: torch.device):
        self.body, self.owner, self.device = body, owner, device
        self._eager_done = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def recorded(self) -> bool:
        """True once the step replays from its graph."""
        return self._graph is not None

    def run(self) -> None:
        """One step: eager while warming up, then the recording (which runs this step), then replays."""
        with torch.cuda.device(self.device):  # streams and recordings are the current device's: a worker's may differ
            self._run()

    def _run(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        elif self._eager_done < EAGER_STEPS - 1 or not recordable(self.owner):
            self._eager_done += 1
            self.body()
        elif self._eager_done == EAGER_STEPS - 1:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.body()
            torch.cuda.current_stream().wait_stream(side)
            self._eager_done += 1
        else:
            self._record()

    def _record(self) -> None:
        """Record the step and replay it; a step that cannot be recorded runs eagerly (:class:`Recordings` says whether
        the next one tries again)."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads of the process (agents, a host's uploads) may use CUDA meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.body()
        except RuntimeError as exc:  # nothing recorded ran: the step is still to take
            _recordings.failed(self.owner, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.body()
            return
        _recordings.succeeded(self.owner)
        self._graph = graph
        graph.replay()
