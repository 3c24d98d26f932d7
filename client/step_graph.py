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
# Models whose step could not be recorded (an operation that waits for the host, say): they stay eager for the life of
# the model, and the reason is logged once.
_unrecordable: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()


def recordable(owner: object) -> bool:
    """False once a step of ``owner`` (a model) failed to record."""
    return owner not in _unrecordable


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
        """Record the step and replay it; a step that cannot be recorded runs eagerly (and its model stays eager)."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads of the process (agents, a host's uploads) may use CUDA meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.body()
        except RuntimeError as exc:  # nothing recorded ran: the step is still to take
            _unrecordable[self.owner] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("client batching: this model's step could not be recorded as a CUDA graph (%s); it runs "
                        "eagerly, one kernel launch at a time", _unrecordable[self.owner])
            self.body()
            return
        self._graph = graph
        graph.replay()
