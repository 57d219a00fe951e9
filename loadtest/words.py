"""Common English words that seeded prompts are made of (the engine benchmark's chat asks, the load
generator's word prompts): one list, so both draw from the same vocabulary."""

from __future__ import annotations

# The first 26 are the engine benchmark's (its seeded prompts depend on them and on their order).
WORDS: tuple[str, ...] = (
    "weave",
    "loom",
    "thread",
    "pattern",
    "color",
    "market",
    "river",
    "mountain",
    "history",
    "science",
    "music",
    "garden",
    "winter",
    "machine",
    "language",
    "story",
    "ocean",
    "forest",
    "city",
    "travel",
    "recipe",
    "planet",
    "energy",
    "memory",
    "friend",
    "design",
    "bridge",
    "candle",
    "window",
    "orchard",
    "harbor",
    "lantern",
    "meadow",
    "signal",
    "engine",
    "paper",
    "silver",
    "morning",
)
BENCHMARK_WORDS = WORDS[:26]
