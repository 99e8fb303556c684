"""Which replica serves a request: round-robin, least load, or the longest cached prefix.

A policy sees, per request, the prefix keys of its prompt (prefix_keys.py) and a load snapshot
of every replica, and returns a replica index. Policies hold only routing state (a cursor, the
prefix table): the front owns the replicas and their loads (backends.py). Pure Python, no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROUTING_POLICIES = ("load", "prefix", "round_robin")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as the front knows it.

    in_flight: requests the front has forwarded there and not yet seen finish (exact, now).
    waiting: requests waiting in its scheduler, from its latest /metrics (may lag by a poll).
    kv_usage: fraction of its KV blocks in use, from the same poll, in [0, 1].
    healthy: False while its process is gone or its /health fails: never chosen then.
    """

    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0
    healthy: bool = True

    @property
    def score(self) -> float:
        """Lower is lighter: open requests, a waiting one counting twice (it holds a slot in
        the front's count and delays everyone behind it there)."""
        return self.in_flight + self.waiting


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """The healthy replica with the lowest score, then the lowest KV usage, then index.

    Raises:
        RuntimeError: no replica is healthy.
    """
    healthy = [i for i, load in enumerate(loads) if load.healthy]
    if not healthy:
        raise RuntimeError("no replica is healthy")
    return min(healthy, key=lambda i: (loads[i].score, loads[i].kv_usage, i))


class RoutingPolicy(Protocol):
    def choose(self, keys: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> int:
        """The replica for a request with prefix ``keys`` given every replica's load."""
        ...


class RoundRobin:
    """Each healthy replica in turn, whatever the load or the prompt (the baseline)."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, keys: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> int:
        for _ in range(len(loads)):
            index = self._next % len(loads)
            self._next += 1
            if loads[index].healthy:
                return index
        raise RuntimeError("no replica is healthy")


class LeastLoad:
    """The least loaded replica (``least_loaded``)."""

    def choose(self, keys: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)


@dataclass
class PrefixStats:
    """Counters of PrefixAware's decisions (the front's /metrics shows them)."""

    routed: int = 0  # requests routed
    matched: int = 0  # ... sent where the table said their longest prefix is
    hashed: int = 0  # ... sent by the hash ring (no useful match)
    rebalanced: int = 0  # ... sent to the least loaded replica, the chosen one overloaded


@dataclass
class _Entry:
    """What the prefix table knows of one key: the replica that last served a prompt through
    it; the key that followed it there (None: the prompt ended); whether prompts went on from
    it in different ways (a shared prefix, such as a system prompt, not one conversation's)."""

    replica: int
    next_key: bytes | None = None
    shared: bool = False


class PrefixAware:
    """The replica that holds the request's longest cached prefix, as SGLang's cache-aware
    router, with consistent hashing for prompts it has not seen and a load guard.

    The table maps a prefix key to the replica that last served a prompt with that prefix
    (that replica's prefix cache holds those blocks, unless it evicted them since): an LRU of
    at most ``max_entries`` keys. A request walks its keys from the first until a miss; the
    deepest hit names the replica, unless the request leaves the known path at a shared key
    (prompts already branched there: a system prompt every conversation starts with should
    not pull them all to one replica). Otherwise the hash ring (``virtual_nodes`` points per
    replica) maps the request's deepest key, so distinct prompts spread evenly and a replica
    joining or leaving moves only its share. Either choice gives way to the least loaded
    replica when it is overloaded: its score is over both ``abs_margin`` plus and
    ``rel_margin`` times the lightest one's. Every key of the request then records the replica
    that got it.
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        max_entries: int = 1 << 16,
        abs_margin: float = 8.0,
        rel_margin: float = 1.5,
        virtual_nodes: int = 64,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"PrefixAware: num_replicas must be >= 1, got {num_replicas}")
        if max_entries < 1:
            raise ValueError(f"PrefixAware: max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.abs_margin = abs_margin
        self.rel_margin = rel_margin
        self.stats = PrefixStats()
        self._table: OrderedDict[bytes, _Entry] = OrderedDict()
        points = [
            (_ring_point(f"replica-{r}-{v}".encode()), r)
            for r in range(num_replicas)
            for v in range(virtual_nodes)
        ]
        points.sort()
        self._ring_points = [p for p, _ in points]
        self._ring_owners = [r for _, r in points]

    def choose(self, keys: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> int:
        self.stats.routed += 1
        if not keys:
            return least_loaded(loads)
        chosen = self._longest_match(keys, loads)
        if chosen is None:
            chosen = self._ring(keys[-1], loads)
            self.stats.hashed += 1
        else:
            self.stats.matched += 1
        lightest = least_loaded(loads)
        if self._overloaded(loads[chosen], loads[lightest]):
            chosen = lightest
            self.stats.rebalanced += 1
        self._record(keys, chosen)
        return chosen

    def _longest_match(self, keys: Sequence[bytes], loads: Sequence[ReplicaLoad]) -> int | None:
        depth = 0
        while depth < len(keys) and keys[depth] in self._table:
            depth += 1
        if depth == 0:
            return None
        last = self._table[keys[depth - 1]]
        branches = depth < len(keys) and last.next_key not in (None, keys[depth])
        if (last.shared and depth < len(keys)) or branches:
            return None  # a prefix many prompts share, not this one's own
        return last.replica if loads[last.replica].healthy else None

    def _record(self, keys: Sequence[bytes], replica: int) -> None:
        for i, key in enumerate(keys):
            follower = keys[i + 1] if i + 1 < len(keys) else None
            entry = self._table.get(key)
            if entry is None:
                self._table[key] = _Entry(replica, follower)
            else:
                entry.replica = replica
                if follower is not None and entry.next_key not in (None, follower):
                    entry.shared = True
                entry.next_key = follower or entry.next_key
                self._table.move_to_end(key)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def _ring(self, key: bytes, loads: Sequence[ReplicaLoad]) -> int:
        """The owner of the first ring point at or after the key's, skipping unhealthy ones."""
        start = bisect.bisect_left(self._ring_points, _ring_point(key))
        n = len(self._ring_points)
        for step in range(n):
            owner = self._ring_owners[(start + step) % n]
            if loads[owner].healthy:
                return owner
        raise RuntimeError("no replica is healthy")

    def _overloaded(self, chosen: ReplicaLoad, lightest: ReplicaLoad) -> bool:
        return (
            chosen.score > lightest.score + self.abs_margin
            and chosen.score > lightest.score * self.rel_margin
        )


def _ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def make_policy(name: str, num_replicas: int) -> RoutingPolicy:
    """The policy named ``name`` (ROUTING_POLICIES) over ``num_replicas`` replicas.

    Raises:
        ValueError: an unknown name.
    """
    if name == "round_robin":
        return RoundRobin()
    if name == "load":
        return LeastLoad()
    if name == "prefix":
        return PrefixAware(num_replicas)
    raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {name!r}")
