"""Which precision a layout really trains in, and refusing bf16 where nothing would apply it.

bf16 reaches the model two ways: FSDP2's ``MixedPrecisionPolicy`` (any device; --fsdp > 1), or autocast around
the forward of a model that is neither FSDP-wrapped nor pipelined, which is only done on GPUs (CPU autocast is
slow and the documented CPU rule is fp32). Pipeline stages without FSDP get neither: torch's pipeline schedules
run forward and backward inside ``step``, so torchtitan, like us, leaves their precision to FSDP.
"""

from __future__ import annotations

from fedpar.parallel.config import ConfigurationError, ParallelConfig

BF16, FP32 = "bf16", "fp32"


def _bf16_mechanism(config: ParallelConfig, device_type: str) -> str | None:
    if config.fsdp > 1:
        return "fsdp"
    if device_type == "cuda" and config.pp == 1:
        return "autocast"
    return None


def resolve_precision(config: ParallelConfig, device_type: str) -> str:
    """The precision training runs in ("bf16" or "fp32"); a bf16 request that nothing would apply is an error."""
    mode = config.mixed_precision
    if mode == FP32:
        return FP32
    mechanism = _bf16_mechanism(config, device_type)
    if mode == "auto":
        return BF16 if device_type == "cuda" and mechanism else FP32
    if mechanism is None:
        if device_type != "cuda":
            raise ConfigurationError(
                "--mixed-precision bf16 would have no effect here: on CPU only FSDP2 (--fsdp > 1) trains in "
                "bf16, everything else runs in fp32 (the CPU rule); use --mixed-precision fp32 (or auto), or "
                "shard with --fsdp 2 or more")
        raise ConfigurationError(
            "--mixed-precision bf16 would have no effect: pipeline stages (--pp > 1) get bf16 only from FSDP2's "
            "MixedPrecisionPolicy; add --fsdp 2 or more, or use --mixed-precision fp32 (or auto)")
    return BF16


def uses_autocast(precision: str, config: ParallelConfig, device_type: str) -> bool:
    """True when the trainer must wrap forward passes in bf16 autocast itself (no FSDP, no pipeline)."""
    return precision == BF16 and _bf16_mechanism(config, device_type) == "autocast"
