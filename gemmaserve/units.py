"""Byte sizes as users write them ("64MiB", "1.5GB") and as we print them ("1.5 KiB"). The bottom of
the package: it imports nothing of ours but the error type."""

from __future__ import annotations

from .errors import UserInputError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'64MiB', '1.5GB', '4096' -> bytes."""
    raw = str(text).strip().lower().replace(" ", "")
    number_part = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number_part):]
    try:
        value = float(number_part)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise UserInputError(f"invalid size {text!r}: expected a positive number with an optional unit "
                             "such as 512MiB, 2GiB or 1.5GB")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
