"""``loom soak``: minutes of mixed load against a served Loom with faults injected on a schedule, every
delivered token checked; ``loom soak --fuzz N`` sends N fuzz cases instead (loadtest/soak.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from loadtest import soak

    soak.register(sub)
