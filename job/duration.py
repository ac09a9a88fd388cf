"""Durations as people type them for schedulers ('45m', '11h30m') to seconds, and back."""

from __future__ import annotations

import re

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '45m', '1h30m', '2d'. Written here because pydantic's durations are ISO 8601
    ('PT1H30M') or clock times, not the '11h30m' people type for schedulers. Raises ValueError."""
    text = text.strip().lower().replace(" ", "")
    try:
        return float(text)
    except ValueError:
        pass
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or parts is None:
        raise ValueError("expected seconds or a duration such as 45m, 11h30m, 2d")
    return sum(float(n) * UNITS[u] for n, u in zip(parts.groups(), "dhms") if n)


def format_duration(seconds: float) -> str:
    """'2h', '1h30m', '45s', '1.5s': the shortest exact way to say it."""
    if seconds != int(seconds) or seconds < 60:
        return f"{seconds:g}s"
    out, left = "", int(seconds)
    for unit, size in UNITS.items():
        if left >= size:
            out, left = out + f"{left // size}{unit}", left % size
    return out
