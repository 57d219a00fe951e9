"""Scheduling classes: strict between classes, interactive before standard before batch."""

from __future__ import annotations

from enum import StrEnum

_SERVICE_ORDER = {"interactive": 0, "standard": 1, "batch": 2}


class Priority(StrEnum):
    """A request's scheduling class, named by its string value in stores, APIs and metrics.

    Ordering follows service order, not the alphabet: ``a < b`` means ``a`` is served before ``b``
    (so ``min`` of a set of priorities is the one served first).
    """

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def order(self) -> int:
        """0 for the class served first."""
        return _SERVICE_ORDER[self.value]

    def capped_at(self, ceiling: Priority) -> Priority:
        """This priority, lowered to ``ceiling`` when it would be served before it."""
        return ceiling if self < ceiling else self

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Priority):
            return NotImplemented
        return self.order < other.order

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Priority):
            return NotImplemented
        return self.order <= other.order

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Priority):
            return NotImplemented
        return self.order > other.order

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Priority):
            return NotImplemented
        return self.order >= other.order

    __hash__ = StrEnum.__hash__
