"""The FedOpt family (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2).

The averaged client delta ``Delta = average - global`` is a pseudo-gradient (ascent direction):
  m = b1*m + (1-b1)*Delta
  v = b2*v + (1-b2)*Delta^2                          (FedAdam)
  v = v - (1-b2)*Delta^2*sign(v - Delta^2)           (FedYogi)
  v = v + Delta^2                                    (FedAdagrad)
  x = x + eta * m / (sqrt(v) + tau)
with m and v starting at zero (as in Flower; the paper also allows v_{-1} = tau^2). The paper has no
bias correction; ``bias_correction=True`` scales eta by sqrt(1-b2^t)/(1-b1^t) as in Adam (t = server steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpar.aggregation.accumulator import FoldConfig, cast_like
from fedpar.aggregation.catalog import register_strategy
from fedpar.aggregation.strategy import StreamingStrategy


class FedOpt(StreamingStrategy):
    """Adaptive server optimizer on the averaged pseudo-gradient; subclasses define the second-moment rule."""

    memory_note = StreamingStrategy.memory_note + "; plus first and second moment buffers (2 models, float32/64)"

    def __init__(self, eta: float = 1e-1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-9,
                 fold_config: FoldConfig | None = None, bias_correction: bool = False) -> None:
        """Server learning rate ``eta``, moment factors, adaptivity ``tau``, optional Adam bias correction."""
        super().__init__(fold_config)
        self.bias_correction = bool(bias_correction)
        self.steps = 0
        if eta <= 0 or tau <= 0 or not 0 <= beta_1 < 1 or not 0 <= beta_2 < 1:
            raise ValueError("need eta > 0, tau > 0, 0 <= beta_1 < 1, 0 <= beta_2 < 1")
        self.eta, self.beta_1, self.beta_2, self.tau = float(eta), float(beta_1), float(beta_2), float(tau)
        self.m: list[np.ndarray] | None = None
        self.v: list[np.ndarray] | None = None

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """The second-moment update rule."""
        raise NotImplementedError

    def _server_update(self, global_weights: list[np.ndarray], average: list[np.ndarray]) -> list[np.ndarray]:
        """One adaptive step."""
        assert self._acc is not None
        dts = self._acc.acc_dtypes
        deltas = [np.asarray(a, dt) - np.asarray(g, dt) for g, a, dt in zip(global_weights, average, dts)]
        if self.m is None or self.v is None or [m.shape for m in self.m] != [d.shape for d in deltas]:
            self.m = [np.zeros_like(d) for d in deltas]
            self.v = [np.zeros_like(d) for d in deltas]
        b1 = self.beta_1
        self.steps += 1
        eta = self.eta
        if self.bias_correction:
            eta *= float(np.sqrt(1 - self.beta_2 ** self.steps) / (1 - b1 ** self.steps))
        new = []
        for i, (g, d) in enumerate(zip(global_weights, deltas)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * d
            self.v[i] = self._second_moment(self.v[i], d * d)
            step = eta * self.m[i] / (np.sqrt(self.v[i]) + self.tau)
            new.append(cast_like(np.asarray(g, d.dtype) + step, g.dtype))
        return new

    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Moments and hyper-parameters."""
        arrays: dict[str, np.ndarray] = {}
        for i, (m, v) in enumerate(zip(self.m or [], self.v or [])):
            arrays[f"m.{i}"] = m
            arrays[f"v.{i}"] = v
        return arrays, {"eta": self.eta, "beta_1": self.beta_1, "beta_2": self.beta_2, "tau": self.tau,
                        "bias_correction": self.bias_correction, "steps": self.steps,
                        "num_arrays": len(self.m or [])}

    def _load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore the moments."""
        n = int(meta.get("num_arrays", 0))
        self.steps = int(meta.get("steps", 0))
        self.m = [np.array(arrays[f"m.{i}"]) for i in range(n)] or None
        self.v = [np.array(arrays[f"v.{i}"]) for i in range(n)] or None


@register_strategy
class FedAdam(FedOpt):
    """FedOpt with Adam's second moment: ``v = b2*v + (1-b2)*Delta^2``."""

    name = "fedadam"

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """Exponential moving average of the squared delta."""
        return self.beta_2 * v + (1 - self.beta_2) * delta_sq


@register_strategy
class FedYogi(FedOpt):
    """FedOpt with Yogi's second moment: ``v = v - (1-b2)*Delta^2*sign(v - Delta^2)``."""

    name = "fedyogi"

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 fold_config: FoldConfig | None = None, bias_correction: bool = False) -> None:
        """Flower's defaults for Yogi (eta 1e-2, tau 1e-3)."""
        super().__init__(eta, beta_1, beta_2, tau, fold_config, bias_correction)

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """Additive, sign-controlled update."""
        return v - (1 - self.beta_2) * delta_sq * np.sign(v - delta_sq)


@register_strategy
class FedAdagrad(FedOpt):
    """FedOpt with Adagrad's second moment: ``v = v + Delta^2``."""

    name = "fedadagrad"

    def __init__(self, eta: float = 1e-1, beta_1: float = 0.0, beta_2: float = 0.0, tau: float = 1e-9,
                 fold_config: FoldConfig | None = None, bias_correction: bool = False) -> None:
        """Adagrad has no second-moment decay; beta_1 defaults to 0 (plain Adagrad, as in Flower)."""
        super().__init__(eta, beta_1, beta_2, tau, fold_config, bias_correction)

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """Sum of squared deltas."""
        return v + delta_sq
