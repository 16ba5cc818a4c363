"""Start-time fair queuing over tenants: the order a shard's callers, or a queue's jobs, are served in."""

from __future__ import annotations

__all__ = ["FairOrder"]


class FairOrder:
    """Tags that order waiting items of several tenants fairly, weighted; the lowest is served first.

    A tenant's ``k``-th waiting item gets a tag after every other tenant's
    ``k * weight / their weight``-th: tenants take turns, ``weight`` items
    at a time, first come first served inside each. A tenant that comes
    back after waiting nothing starts from the tag served last, so it gets
    no credit for the time it was away.
    """

    __slots__ = ("_tags", "served")

    def __init__(self) -> None:
        #: the tag of the latest item served
        self.served = 0.0
        #: each tenant's latest tag
        self._tags: dict[str, float] = {}

    def tag(self, tenant: str, weight: int, waiting: int) -> float:
        """The tag of a new item of ``tenant`` (of ``weight``), with ``waiting`` items waiting now."""
        tags = self._tags
        start = tags.get(tenant, 0.0)
        if start < self.served:
            start = self.served
        tag = tags[tenant] = start + 1.0 / weight
        if len(tags) > 2 * waiting + 16:  # forget the tenants served up to now
            self._tags = {name: value for name, value in tags.items() if value > self.served}
        return tag

    def serve(self, tag: float) -> None:
        """The item of ``tag`` is served (started): later newcomers start from it."""
        if tag > self.served:
            self.served = tag
