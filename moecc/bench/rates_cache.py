"""Where this machine's measured rates are kept, and reading them without measuring: no torch, nothing heavy, so
``paradigm="auto"`` can read them from ``moecc.paradigms`` (``moecc.bench.rates`` measures through the public API,
which imports the paradigms)."""
from __future__ import annotations

import json
import os
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moecc" / "rates.json"
VERSION = 8  # bumped whenever what is timed changes, so an older cache is measured again


def cached(cache: Path | None = None) -> dict | None:
    """The rates saved in ``cache`` (default ``CACHE``) by this version of ``moecc.bench.rates``, measuring
    nothing; None where there are none (never measured, another version, an unreadable file)."""
    cache = cache or CACHE
    try:
        saved = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.pop("version", None) != VERSION:
        return None
    return saved
