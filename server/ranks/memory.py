"""Whether the aggregator ranks `fedpar serve --aggregator-ranks N` (or `fedpar simulate`'s) starts on this machine fit
its memory, said in one line before any of them starts (parallel/preflight.py check_ranks_fit: the estimate `train
--nproc` uses)."""

from __future__ import annotations

from fedpar.parallel.preflight import check_ranks_fit

# One aggregator rank forked from `serve`'s launcher, before its model: measured 56-61 MiB of memory of its own (USS,
# /proc/PID/smaps_rollup) over 3 ranks serving a synthetic model of 10^6 and of 10^7 parameters (2 cores, 24 GiB)
AGGREGATOR_RANK_BYTES = 64 << 20
# Each parameter of the model, per rank: measured 12 bytes of a rank's own as it waits for the first round (the
# global weights, and what building them left), and 21-22 at its peak in a round (the running sum, the uploads it
# decodes, the new weights): 144-146 MiB per rank of a 4*10^6-parameter model, 2 ranks, 4 agents
# (benchmarks/aggregator_ranks_bench.py's serve, sampled every 0.1 s)
AGGREGATOR_BYTES_PER_PARAMETER = 24


SERVE_ADVICE = "give a smaller --aggregator-ranks, or launch the ranks on several machines with torchrun"


def check_aggregator_ranks_fit(ranks: int, parameters: int = 0, advice: str = SERVE_ADVICE) -> None:
    """ValueError, one line (ending with ``advice``), when ``ranks`` aggregator ranks started here, each holding a
    model of ``parameters`` (0: not known yet, as a service's, whose runs bring their own), need more memory than
    this machine has available."""
    check_ranks_fit(ranks, f"serving on {ranks} aggregator ranks here (--aggregator-ranks {ranks})", advice,
                    parameters, rank_bytes=AGGREGATOR_RANK_BYTES, parameter_bytes=AGGREGATOR_BYTES_PER_PARAMETER)
