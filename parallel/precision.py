"""Whether the trainer wraps forward passes in autocast itself.

bf16 reaches the model two ways: FSDP2's ``MixedPrecisionPolicy`` (any device; --fsdp > 1), or autocast around
the forward of a model that is neither FSDP-wrapped nor pipelined, which is only done on GPUs (CPU autocast is
slow and the documented CPU rule is fp32). Pipeline stages without FSDP get neither: torch's pipeline schedules
run forward and backward inside ``step``, so torchtitan, like us, leaves their precision to FSDP. Which precision a
layout trains in is decided once, when it is resolved (``ParallelLayout.precision``, parallel/config.py).
"""

from __future__ import annotations

from fedpar.parallel.config import BF16, ParallelLayout, bf16_mechanism


def uses_autocast(layout: ParallelLayout) -> bool:
    """True when the trainer must wrap forward passes in bf16 autocast itself (no FSDP, no pipeline)."""
    return layout.precision == BF16 and bf16_mechanism(layout, layout.device_type) == "autocast"
