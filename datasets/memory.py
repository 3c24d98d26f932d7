"""How much memory this machine has free, and one line saying what a too-big job needs before it starts."""

from __future__ import annotations

GIB = 1 << 30


def available_bytes() -> int | None:
    """The memory the kernel says can be had without swapping (MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(needed: int, what: str, advice: str) -> None:
    """ValueError saying how much ``what`` needs when that is more than the memory available (``advice``: what to
    do instead); nothing when it fits or the machine does not say."""
    free = available_bytes()
    if free is not None and needed > free:
        raise ValueError(f"{what} needs about {_gib(needed)} GiB of memory and this machine has "
                         f"{free / GIB:.1f} GiB available; {advice}")


def _gib(size: float) -> str:
    """``size`` bytes in GiB, to a tenth (in powers of ten once its digits would fill the line)."""
    return f"{size / GIB:.1f}" if size < 1e9 * GIB else f"{size / GIB:.2g}"
