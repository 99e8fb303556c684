"""Scheduling policies: the order of the waiting queue and of the running list.

Both policies rank requests by a key; a smaller key is served first and preempted last:

    fcfs:     (arrival_time, arrival_index)
    priority: (priority, arrival_time, arrival_index)   lower priority value = served first

The scheduler keeps ``running`` sorted by this key, so the preemption victim (the
lowest-ranked running request) is always ``running[-1]``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.request import Request

SortKey = tuple[float | int, ...]


def fcfs_key(request: Request) -> SortKey:
    return (request.arrival_time, request.arrival_index)


def priority_key(request: Request) -> SortKey:
    return (request.priority, request.arrival_time, request.arrival_index)


class FCFSWaitingQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def put_back(self, requests: list[Request]) -> None:
        """Return requests popped this step (skipped, not scheduled) to the front, in order."""
        self._queue.extendleft(reversed(requests))

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # O(len); only on abort

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityWaitingQueue:
    """Waiting requests as a heap on ``priority_key``; a preempted one re-enters at its key."""

    def __init__(self) -> None:
        self._heap: list[tuple[SortKey, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def remove(self, request: Request) -> None:
        # O(len); only on abort. Keys are unique (arrival_index), so requests never compare.
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[1] for item in self._heap)


WaitingQueue = FCFSWaitingQueue | PriorityWaitingQueue


def make_policy(name: str) -> tuple[WaitingQueue, Callable[[Request], SortKey]]:
    """The waiting queue and the running-order key of policy ``name`` ("fcfs" | "priority")."""
    if name == "fcfs":
        return FCFSWaitingQueue(), fcfs_key
    if name == "priority":
        return PriorityWaitingQueue(), priority_key
    raise ValueError(f"SchedulerConfig.policy must be 'fcfs' or 'priority', got {name!r}")
