"""Privacy accounting for DP federated rounds: opacus's RDP accountant with a JSON-able history.

One federated round is one step of the subsampled Gaussian mechanism: noise multiplier ``sigma`` on a sum
with sensitivity equal to the clip norm, clients sampled with rate ``q``. opacus's ``RDPAccountant``
(Mironov 2017; Mironov, Talwar, Zhang 2019) composes the steps and converts to (epsilon, delta).
"""

from __future__ import annotations

import math
import warnings
from typing import Any


def _rdp_accountant():
    """A fresh opacus RDPAccountant (imported lazily: opacus is only needed when DP is on)."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError as exc:  # pragma: no cover - opacus is a declared dependency
        raise ImportError("differential privacy needs opacus: pip install opacus") from exc
    return RDPAccountant()


class PrivacyAccountant:
    """Tracks (sigma, q, steps) and reports epsilon at a fixed delta; its history round-trips through JSON."""

    def __init__(self, delta: float) -> None:
        """Report epsilon at ``delta`` (0 < delta < 1; typically below 1 / population)."""
        if not 0 < delta < 1:
            raise ValueError(f"dp delta must be in (0, 1), got {delta}")
        self.delta = float(delta)
        self._history: list[tuple[float, float, int]] = []
        # opacus is imported (2.5 s of CPU: scipy.stats, sympy) only when epsilon is first asked for: an aggregator
        # rank other than 0 and a strategy built to be checked never ask
        self._accountant = None

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Composed mechanisms as (noise_multiplier, sample_rate, num_steps), consecutive equal ones merged."""
        return list(self._history)

    @property
    def steps(self) -> int:
        """Number of rounds accounted for."""
        return sum(n for _, _, n in self.history)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        """Account one round of the subsampled Gaussian mechanism."""
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"noise multiplier must be a finite number > 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        sigma, q = float(noise_multiplier), float(sample_rate)
        if self._history and self._history[-1][:2] == (sigma, q):  # merged as opacus's RDPAccountant.step does
            self._history[-1] = (sigma, q, self._history[-1][2] + 1)
        else:
            self._history.append((sigma, q, 1))

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` (0.0 before the first round)."""
        if not self._history:
            return 0.0
        if self._accountant is None:
            self._accountant = _rdp_accountant()
        self._accountant.history = list(self._history)
        with warnings.catch_warnings():
            # At an edge of opacus's orders (a noise of 1e30 or 0.01) epsilon is still an upper bound, only a looser
            # one: opacus says so in a two-line UserWarning that a user of fedpar can do nothing about.
            warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
            return float(self._accountant.get_epsilon(delta=self.delta))

    def state(self) -> dict[str, Any]:
        """JSON-able state: delta and the history."""
        return {"delta": self.delta, "history": [list(h) for h in self.history]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the history :meth:`state` returned (validated); epsilon stays reported at this ``delta``."""
        history = []
        for entry in state.get("history", []):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(f"bad accountant history entry {entry!r}; expected [sigma, q, steps]")
            sigma, q, n = float(entry[0]), float(entry[1]), int(entry[2])
            if not (sigma > 0 and math.isfinite(sigma) and 0 < q <= 1 and n >= 1):
                raise ValueError(f"bad accountant history entry {entry!r}")
            history.append((sigma, q, n))
        self._history = history
