"""Differentially private aggregation: DP-FedAvg as a wrapper around any strategy.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"):
  * each update's delta from the global model is clipped to whole-model L2 norm ``C``;
  * deltas are weighted *uniformly*, not by ``num_examples``: with example-count weights one client's
    influence on the sum would depend on its (unbounded, self-reported) weight, so the sum's sensitivity
    would no longer be ``C``;
  * Gaussian noise ``N(0, (z C)^2)`` is added to the *sum* of clipped deltas, which is then divided by the
    fixed expected cohort size ``clients_per_round`` (the fixed-denominator estimator of the paper), not by
    the number of updates received: that number depends on who took part, so dividing by it would make the
    noise scale data-dependent and break the Gaussian-mechanism analysis. If fewer updates arrive the step
    is simply shorter;
  * the noisy mean delta is handed to the wrapped strategy as if it were one client's update, so FedAvgM,
    FedAdam etc. post-process it (post-processing does not cost privacy).

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping") moves ``C``
geometrically toward a target quantile of the update norms using a noisy count of unclipped updates; the
count's noise shares the privacy budget, so the updates get the larger multiplier
``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` and the accountant is charged ``z``.

Modes: ``central`` (the server clips; clients send raw updates) and ``client`` (Flower's client-side
fixed clipping: clients clip before uploading, optionally adding local noise; the server still adds the
central noise and *verifies* each update is within ``C``, refusing any that is not, so a lying client
cannot break the bound). With local noise ``N(0, (s C)^2 I)`` the server cannot verify the clip and clips
each noisy update back to ``C`` itself: under add/remove adjacency (the accountant's) a client's whole
contribution, noise included, must be bounded for the central guarantee. The local noise then protects the
client from the coordinator; its norm is about ``s C sqrt(d)``, so once ``s sqrt(d) >> 1`` the re-clip
shrinks the signal by about ``1 / (s sqrt(d))``. In client mode each client reports whether it clipped its update
(its clip bit, ``dp_clipped`` in the upload's report, as in Andrew et al.): the norm the server sees is after local
noise and lossy compression, which move it off ``C``, so ``dp_clipped_fraction`` and adaptive clipping count the
clients' bits (with local noise too); a client that sends no bit is judged by the norm.
Under secure aggregation (client mode without local noise) each agent masks its clipped update with weight 1 and
its clip bit after it; the server sees only their sum (:meth:`DPStrategy.fold_secure_sum`) and adds the noise to it.
It cannot check a masked update's norm, so there the agents' clip is trusted, not verified.

Accounting: one round is one step of the sampled Gaussian mechanism with multiplier ``z`` and sampling
rate ``q = sampled_per_round / population``, composed by opacus's RDP accountant. That analysis assumes
Poisson sampling of the population; the coordinator samples a fixed-size cohort uniformly among the *live*
agents and counts the first ``clients_per_round`` of them, the usual approximation (as in McMahan et al.
2018). Counting every sampled agent as a participant bounds its participation probability from above only
if ``population`` is the number of live agents: if fewer are live, the true rate is higher and the
reported epsilon is too low. An aborted round releases nothing and is not charged.

Metrics added to each round: ``dp_epsilon`` (at ``dp_delta``), ``dp_clip_norm`` (used this round),
``dp_noise_multiplier`` (for the updates: ``z`` or ``z_delta``), ``dp_noise_std`` (per-coordinate std of
the noise in the mean delta handed to the wrapped strategy, ``z_delta C / clients_per_round``),
``dp_clipped_fraction``, ``dp_sample_rate`` and, with adaptive clipping, ``dp_noisy_unclipped_fraction``.

Trust model: the coordinator is the trusted curator and the released model is what is private. The
metrics row (exact clipped fraction, train loss, ...) is operator-side diagnostics and is not privatized.
The noise comes from numpy's PCG64 generator (fresh OS entropy each round unless a seed is given, for
tests): it is not a cryptographically secure source, and like most DP libraries it does not defend
against floating-point attacks on the Gaussian sampler (Mironov 2012).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fedpar.aggregation.accountant import PrivacyAccountant
from fedpar.aggregation.accumulator import FoldConfig, ShapesAndDtypes, WeightedSum, cast_like
from fedpar.aggregation.clipping import CHUNK, AdaptiveClipping, clip_factor, delta_norm, effective_noise_multiplier
from fedpar.aggregation.compatibility import privacy_level
from fedpar.aggregation.strategy import Strategy
from fedpar.protocol.task_settings import TaskSettings

MODES = ("central", "client")
# A client-clipped update is rebuilt in float32 by the client; allow for that rounding, nothing more.
CLIENT_CLIP_TOLERANCE = 1e-4  # relative
CLIENT_CLIP_ATOL = 1e-6


class _ClipBit(threading.local):
    """The clip bit of the update :meth:`DPStrategy.fold` is folding on this thread (None: it said none)."""

    clipped: bool | None = None


class DPStrategy(Strategy):
    """Clips, uniformly weights and noises updates, accounts privacy, then defers to ``inner``."""

    memory_note = ("streaming: one accumulator of the model size plus the wrapped strategy's own state; "
                   "updates are not retained")
    linear = False  # each update is clipped by its own norm before it is summed

    @staticmethod
    def wrapping(inner_name: str) -> str:
        """The name of the DP wrapper of strategy ``inner_name``."""
        return f"dp-{inner_name}"

    def __init__(self, inner: Strategy, noise_multiplier: float, clip_norm: float, population: int,
                 clients_per_round: int, sampled_per_round: int | None = None, delta: float = 1e-5,
                 mode: str = "central", target_quantile: float | None = None, clip_learning_rate: float = 0.2,
                 count_noise: float | None = None, local_noise_multiplier: float = 0.0, seed: int | None = None,
                 fold_config: FoldConfig | None = None) -> None:
        """Wrap ``inner``; ``target_quantile`` turns on adaptive clipping starting from ``clip_norm``.

        ``population`` is the number of clients that could be sampled; ``clients_per_round`` the expected
        number of updates per round (the fixed denominator); ``sampled_per_round`` how many are asked each
        round (default ``clients_per_round``), giving the sampling rate ``q = sampled / population``.
        """
        super().__init__()
        if isinstance(inner, DPStrategy):
            raise ValueError("a DP strategy cannot wrap another DP strategy")
        if mode not in MODES:
            raise ValueError(f"dp mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"dp noise multiplier must be a finite number > 0, got {noise_multiplier}")
        if not (clip_norm > 0 and math.isfinite(clip_norm)):
            raise ValueError(f"dp clip norm must be a finite number > 0, got {clip_norm}")
        if population < 1 or clients_per_round < 1:
            raise ValueError("dp population and clients_per_round must be >= 1")
        if clients_per_round > population:
            raise ValueError(f"clients_per_round ({clients_per_round}) exceeds the DP population ({population}); "
                             "the population is the number of clients that may be sampled")
        sampled = clients_per_round if sampled_per_round is None else sampled_per_round
        if not clients_per_round <= sampled <= population:
            raise ValueError(f"need clients_per_round ({clients_per_round}) <= sampled_per_round ({sampled}) "
                             f"<= population ({population})")
        if local_noise_multiplier < 0 or (local_noise_multiplier > 0 and mode != "client"):
            raise ValueError("local noise (local DP) is a client-side setting: use it with mode 'client', >= 0")
        self.inner = inner
        self.name = self.wrapping(inner.name)
        self.noise_multiplier = float(noise_multiplier)
        self.clip_norm = float(clip_norm)
        self.population = int(population)
        self.clients_per_round = int(clients_per_round)
        self.sample_rate = sampled / population
        self.mode = mode
        self.local_noise_multiplier = float(local_noise_multiplier)
        self.adaptive: AdaptiveClipping | None = None
        self.update_noise_multiplier = self.noise_multiplier
        if target_quantile is not None:
            # the paper's clients_per_round / 20, but never so small that no update noise is left: at least z, the
            # updates' multiplier then grows by at most 15% (effective_noise_multiplier)
            sigma_b = max(clients_per_round / 20.0, self.noise_multiplier) if count_noise is None \
                else float(count_noise)
            self.adaptive = AdaptiveClipping(float(target_quantile), float(clip_learning_rate), sigma_b)
            self.update_noise_multiplier = effective_noise_multiplier(self.noise_multiplier, sigma_b)
        self.accountant = PrivacyAccountant(delta)
        self.seed = seed
        self.fold_config = fold_config or FoldConfig()
        self._acc: WeightedSum | None = None
        self._unclipped = 0
        self._in_blocks = 0
        self._stats_lock = threading.Lock()
        self._reported = _ClipBit()

    # ------------------------------------------------------------------ secure aggregation
    @property
    def privacy_level(self) -> str:
        """'central', 'client', or client with local noise (aggregation/compatibility.py tells them apart)."""
        return privacy_level(self.mode, self.local_noise_multiplier)

    @property
    def secure_values(self) -> int:
        """Client mode: each agent's clip bit rides after its masked update (their count is all the server sees)."""
        return 1 if self.mode == "client" else 0

    def secure_sum_refusal(self) -> str | None:
        """None in client mode without local noise (the agents clip; the noise goes on the unmasked sum), else why."""
        if self.privacy_level != "client":
            return (f"--privacy {self.privacy_level} needs the coordinator to clip each update, which a masked one "
                    "cannot be: use --privacy client without local noise")
        return self.inner.secure_sum_refusal()

    def fold_secure_sum(self, mean: Sequence[np.ndarray], total_weight: int, agents: int,
                        sums: Sequence[float] = ()) -> None:
        """Count the unmasked mean of ``agents`` updates their agents clipped to C (each weighing 1, so
        ``total_weight`` must equal ``agents``) and ``sums[0]``, how many of them clipped: their sum joins the
        round's as theirs would one by one. The server cannot check a masked update's norm: the agents' clip is
        trusted (an agent that skips it exposes only its own data)."""
        self._check_open("fold")
        if self.secure_sum_refusal() is not None:
            raise ValueError(self.secure_sum_refusal())
        if total_weight != agents or agents < 1:
            raise ValueError(f"the secure sum weighs {total_weight} for {agents} agents; under DP each update weighs 1")
        clipped = round(sums[0]) if sums else agents
        if not 0 <= clipped <= agents or abs(sums[0] - clipped) > 0.01:  # (its rounding error is far below 0.01)
            raise ValueError(f"the secure sum counts {sums[0]:.3f} clipped updates of {agents}: an agent masked a "
                             "clip bit other than 0 or 1, or the masks were not removed right")
        self._claim_all(["secure-aggregate"])
        assert self._acc is not None and self._shapes is not None
        arrays = self._shapes.check_update(mean, "the secure sum", False)
        self._acc.fold(arrays, float(agents), check_finite=False, who="the secure sum")
        with self._stats_lock:
            self._unclipped += agents - clipped
            self._in_blocks += agents - 1

    # ------------------------------------------------------------------ configuration
    def client_config(self, round_id: int) -> TaskSettings:
        """The wrapped strategy's settings, plus the clip norm (and local noise) in client mode."""
        if self.inner.configures_from_round and self._global is not None:  # its round opens with ours
            self.inner.begin_round(round_id, self._global)
        settings = self.inner.client_config(round_id)
        if self.mode == "client":
            settings = replace(settings, dp_clip_norm=self.clip_norm, dp_local_noise=self.local_noise_multiplier)
        return settings

    def _rng(self) -> np.random.Generator:
        """Fresh entropy per round, or a per-round stream of ``seed`` (reproducible tests and resumes)."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng([int(self.seed), int(self.round_id)])

    # ------------------------------------------------------------------ round hooks
    def _reset_round(self, shapes: ShapesAndDtypes) -> None:
        """A zeroed running sum of ``factor_k * update_k`` (weights ``factor_k`` sum to the total)."""
        self._acc = WeightedSum(shapes, self.fold_config)
        self._unclipped = 0
        self._in_blocks = 0  # updates beyond one in each secure sum folded (fold_secure_sum)

    def fold(self, update: Sequence[np.ndarray], num_examples: int, client_id: str = "",
             members: Sequence[str] = (), *, known_finite: bool = False, clipped: bool | None = None) -> None:
        """As :meth:`Strategy.fold`; in client mode ``clipped`` (the client's own clip bit) is what counts toward
        ``dp_clipped_fraction`` and adaptive clipping."""
        self._reported.clipped = clipped
        try:
            super().fold(update, num_examples, client_id, members, known_finite=known_finite, clipped=clipped)
        finally:
            self._reported.clipped = None

    def _fold(self, update: Sequence[np.ndarray], num_examples: int, who: str, known_finite: bool) -> None:
        """Clip ``update``'s delta to ``C`` and add it with weight 1 (``num_examples`` is ignored on purpose)."""
        assert self._acc is not None and self._shapes is not None and self._global is not None
        arrays = self._shapes.check_update(update, who, known_finite)
        norm = delta_norm(arrays, self._global)
        c = self.clip_norm
        if self.mode == "client" and self.local_noise_multiplier == 0:
            if norm > c * (1 + CLIENT_CLIP_TOLERANCE) + CLIENT_CLIP_ATOL:
                raise ValueError(f"{who} changes the global model by L2 norm {norm:.6g}, more than the DP clip "
                                 f"norm {c:.6g}; with client-side DP every client must clip its update to "
                                 "dp_clip_norm before uploading. The update was refused")
        unclipped = self._unclipped_by_client(norm, who)
        # sum_k f_k (x_k - g) = sum_k f_k x_k - (sum_k f_k) g: fold the raw update with weight f_k, no copy.
        # The server clips client-clipped updates again so rounding within the tolerance cannot exceed C, and
        # clips noisy ones (local noise) to C, which bounds each client's contribution for the accountant.
        self._acc.fold(arrays, clip_factor(norm, c), check_finite=False, who=who)
        with self._stats_lock:
            self._unclipped += int(unclipped)

    def _unclipped_by_client(self, norm: float, who: str) -> bool:
        """Whether the update now folded was within the clip norm before any clipping. In client mode its client
        says so (Andrew et al.'s clip bit): the norm seen here is after the client's clip, local noise and lossy
        compression, which move it off C. Without the bit (an older client) the norm decides: a clipped update sits
        at C, within the client's rounding, which only a lossless, noiseless upload keeps."""
        reported = self._reported.clipped
        if self.mode == "client" and reported is not None:
            return not reported
        if self.mode == "client" and self.local_noise_multiplier > 0 and self.adaptive is not None:
            raise ValueError(f"{who} does not say whether its client clipped it, which adaptive clipping with local "
                             "noise needs (the noise hides it); the update was refused: run a current fedpar client")
        if self.mode == "client" and self.local_noise_multiplier == 0:
            return norm <= self.clip_norm * (1 - CLIENT_CLIP_TOLERANCE)
        return norm <= self.clip_norm

    def _num_folded(self) -> int:
        """Updates counted so far this round."""
        return self._acc.count + self._in_blocks if self._acc is not None else 0

    # ------------------------------------------------------------------ aggregator ranks
    def partial_sum(self) -> WeightedSum | None:
        """The sum of this rank's clipped updates; rank 0 adds the noise once, after the ranks' sums are added."""
        return self._acc

    def partial_counts(self) -> list[float]:
        """How many of this rank's updates were within the clip norm (adaptive clipping counts them all)."""
        return [float(self._unclipped)]

    def merge_counts(self, others: Sequence[Sequence[float]]) -> None:
        """The other ranks' unclipped updates join this round's count."""
        with self._stats_lock:
            self._unclipped += sum(int(values[0]) for values in others)

    def round_values(self) -> list[float]:
        """The clip norm of this round (adaptive clipping moves it at rank 0)."""
        return [self.clip_norm]

    def set_round_values(self, values: Sequence[float]) -> None:
        """Clip with rank 0's norm this round."""
        self.clip_norm = float(values[0])

    def _drop_round(self) -> None:
        """Forget the running sum (an aborted round releases nothing, so it costs no privacy)."""
        self._acc = None
        if self.inner.configures_from_round:  # opened by client_config
            self.inner.abort_round()

    def _finish(self, global_weights: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, float]]:
        """Noisy mean delta -> wrapped strategy; then account the round and adapt the clip norm."""
        assert self._acc is not None and self._shapes is not None
        rng = self._rng()
        received, clip = self._num_folded(), self.clip_norm
        sum_std = self.update_noise_multiplier * clip
        denominator = float(self.clients_per_round)
        mean = self._noisy_mean(global_weights, sum_std, denominator, rng)
        # The wrapped strategy steps from the mean at the sum's precision (a float16 model's mean, rounded to float16
        # first, would lose the deltas below its rounding step, and a server optimizer's moments with them).
        self.inner.begin_round(self.round_id, [np.asarray(g, m.dtype) for g, m in zip(global_weights, mean)])
        try:
            self.inner.fold(mean, 1)
            stepped, inner_metrics = self.inner.finish()
        except BaseException:
            self.inner.abort_round()
            raise
        new = [cast_like(np.asarray(w), dtype) for w, dtype in zip(stepped, self._shapes.dtypes)]
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        metrics = {k: v for k, v in inner_metrics.items() if k not in ("num_updates", "num_examples", "update_norm")}
        metrics.update(dp_epsilon=self.accountant.epsilon(), dp_delta=self.accountant.delta, dp_clip_norm=clip,
                       dp_noise_multiplier=self.update_noise_multiplier, dp_noise_std=sum_std / denominator,
                       dp_clipped_fraction=1.0 - self._unclipped / received, dp_sample_rate=self.sample_rate)
        if self.adaptive is not None:
            self.clip_norm, noisy_fraction = self.adaptive.next_clip_norm(clip, self._unclipped, denominator, rng)
            metrics["dp_noisy_unclipped_fraction"] = noisy_fraction
        return new, metrics

    def _noisy_mean(self, global_weights: list[np.ndarray], sum_std: float, denominator: float,
                    rng: np.random.Generator) -> list[np.ndarray]:
        """``g + (sum of clipped deltas + N(0, sum_std^2)) / denominator``, computed in the accumulator and kept at
        its precision."""
        acc = self._acc
        assert acc is not None and self._shapes is not None
        weight = acc.total_weight
        out = []
        for view, g, shape in zip(acc.views, global_weights, self._shapes.shapes):
            g = np.ravel(g)
            for s in range(0, view.size, CHUNK):
                v, gs = view[s: s + CHUNK], g[s: s + CHUNK].astype(view.dtype)
                v -= weight * gs  # the sum of clipped deltas
                v += sum_std * rng.standard_normal(v.size, dtype=view.dtype)
                v /= denominator
                v += gs
            out.append(view.reshape(shape))
        return out

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Wrapped strategy's state, the current clip norm and the accountant's history (JSON, no pickle)."""
        arrays, inner_meta = self.inner.state_dict()
        return ({f"inner.{k}": v for k, v in arrays.items()},
                {"inner": inner_meta, "clip_norm": self.clip_norm, "mode": self.mode,
                 "noise_multiplier": self.noise_multiplier, "accountant": self.accountant.state()})

    def _load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore; the privacy history is kept so epsilon keeps growing from where it was."""
        self.inner.load_state_dict({k[len("inner."):]: v for k, v in arrays.items() if k.startswith("inner.")},
                                   meta.get("inner", {}))
        self.accountant.load_state(meta.get("accountant", {}))
        if self.adaptive is not None:
            clip = float(meta.get("clip_norm", self.clip_norm))
            if not (clip > 0 and math.isfinite(clip)):
                raise ValueError(f"checkpointed dp clip norm {clip!r} is not a finite number > 0")
            self.clip_norm = clip
