"""Bytes and seconds as people write them: "16GiB", "500 MB", 2**30; "1.5 ms"."""

from __future__ import annotations

import dataclasses
import math
import re
import time

_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_BYTES = 2**63 - 1
"""The largest memory size read (8 EiB): past it a number is a mistake, and it would not fit
the int64 that XLA and the solver count bytes in."""


def parse_bytes(x: float | str | None) -> int | None:
    """An int of bytes from an int or a string like "16GiB" or "500 MB"; None stays None."""
    if x is None:
        return None
    if isinstance(x, bool):
        raise TypeError(f"memory size must be a number of bytes or a string like '16GiB', got {x!r}")
    if isinstance(x, int) and x > MAX_BYTES:  # 10**400 is no float (tests/test_hardening.py)
        raise ValueError(_too_large(x))
    if isinstance(x, (int, float)):
        if not math.isfinite(x):
            raise ValueError(f"memory size must be a finite number of bytes, got {x!r}")
        if x < 1:
            raise ValueError(f"memory size must be at least 1 byte, got {x!r}")
        if x > MAX_BYTES:
            raise ValueError(_too_large(x))
        return int(x)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(x))
    if not m or m.group(2).lower() not in _BYTES:
        raise ValueError(f"cannot read memory size {x!r}: write bytes as an int or a string like "
                         f"'16GiB', '512MiB', '40GB' (units: {', '.join(k for k in _BYTES if k)})")
    value = float(m.group(1)) * _BYTES[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"memory size must be a finite number of bytes, got {x!r}")
    if value < 1:
        raise ValueError(f"memory size must be at least 1 byte, got {x!r}")
    if value > MAX_BYTES:
        raise ValueError(_too_large(x))
    return int(value)


def _too_large(x) -> str:
    text = (f"about 2**{x.bit_length() - 1}" if isinstance(x, int) else
            f"{x:.3g}" if isinstance(x, float) else repr(x))
    return (f"memory size {text} bytes is more than any device has (at most 2**63 - 1, "
            "8 EiB): give bytes per device, e.g. 16 * 2**30 or '16GiB'")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


@dataclasses.dataclass(frozen=True)
class Deadline:
    """The wall-clock time a whole search must end by: made once by whoever was given the
    limit, passed down, and asked what remains (every stage gets only that).

    No stage starts after `limit_s` (expired); a solve already running may finish its work
    within a grace of `grace` x limit_s more (remaining counts to there), so the whole search
    ends within (1 + grace) x limit_s of the start."""

    limit_s: float
    grace: float = 0.2
    start: float = dataclasses.field(default_factory=time.monotonic)

    def remaining(self) -> float:
        """Seconds a running solve may still take."""
        return max(0.0, self.start + self.limit_s * (1 + self.grace) - time.monotonic())

    def expired(self) -> bool:
        """True once no new stage should start."""
        return time.monotonic() >= self.start + self.limit_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start
