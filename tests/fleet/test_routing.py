"""Routing policies and prefix keys, host side (no engine): prefix keys chain and survive the
turns of a conversation; prefix routing keeps a conversation on its replica, spreads new ones
by the hash ring, rebalances off an overloaded replica, skips unhealthy ones; and on a
simulated multi-turn chat workload its prefix hit rate is >= 0.9x one engine holding the whole
cache and >= 1.5x round-robin's."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import pytest

from jaxserve.fleet.prefix_keys import PrefixKeyConfig, prefix_keys
from jaxserve.fleet.routing import (
    LeastLoad,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    least_loaded,
    make_policy,
)

CFG = PrefixKeyConfig(block_chars=16, block_tokens=4, max_blocks=64)
IDLE = [ReplicaLoad(), ReplicaLoad()]


def _chat(*contents: str) -> dict:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}


def test_prefix_keys_chain_and_extend_turn_by_turn():
    turn1 = prefix_keys(_chat("a" * 40), CFG)
    turn2 = prefix_keys(_chat("a" * 40, "b" * 30, "c" * 30), CFG)
    assert len(turn1) >= 2 and len(turn2) > len(turn1)
    # turn 1's full blocks are a prefix of turn 2's (its last, partial block is not hashed)
    assert turn2[: len(turn1)] == turn1
    # a different first message changes every key (chained)
    other = prefix_keys(_chat("z" + "a" * 39, "b" * 30, "c" * 30), CFG)
    assert not set(other) & set(turn2)
    # equal in every process: no salted hash
    assert prefix_keys({"prompt": "x" * 32}, CFG) == prefix_keys({"prompt": "x" * 32}, CFG)


def test_prefix_keys_of_every_prompt_form():
    assert len(prefix_keys({"prompt": "x" * 33}, CFG)) == 2  # full blocks only
    assert len(prefix_keys({"prompt": list(range(9))}, CFG)) == 2
    assert prefix_keys({"prompt": ["y" * 32, "z"]}, CFG) == prefix_keys({"prompt": "y" * 32}, CFG)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q" * 40}]}]}
    assert prefix_keys(parts, CFG) == prefix_keys(_chat("q" * 40), CFG)
    assert len(prefix_keys({"prompt": "x" * 10_000}, CFG)) == CFG.max_blocks
    for junk in (None, [], "text", {"prompt": 3}, {"messages": "no"}, {"prompt": [1, "a"]}):
        assert prefix_keys(junk, CFG) == []
    with pytest.raises(ValueError, match="block_chars"):
        PrefixKeyConfig(block_chars=0)


def test_a_conversation_stays_on_its_replica_and_new_ones_spread():
    policy = PrefixAware(2)
    history = ["sys " + "s" * 40]
    first = policy.choose(prefix_keys(_chat(*history), CFG), IDLE)
    for turn in range(5):
        history += [f"answer {turn} " + "a" * 20, f"question {turn} " + "q" * 20]
        assert policy.choose(prefix_keys(_chat(*history), CFG), IDLE) == first
    assert policy.stats.matched == 5 and policy.stats.hashed == 1
    spread = Counter(policy.choose(prefix_keys(_chat(f"{i} " + "n" * 40), CFG), IDLE)
                     for i in range(200))  # fmt: skip
    assert min(spread.values()) > 60  # the ring splits distinct prompts roughly evenly


def test_a_shared_system_prompt_does_not_pull_every_conversation_to_one_replica():
    policy = PrefixAware(2)
    system = "You are helpful. " * 8  # 8 blocks every conversation starts with
    chosen = [
        policy.choose(prefix_keys(_chat(system + f"user {i} " + "u" * 40), CFG), IDLE)
        for i in range(100)
    ]
    assert min(Counter(chosen).values()) > 25
    # ... and each conversation's next turn still finds its own replica
    for i in (3, 42, 77):
        turn2 = _chat(system + f"user {i} " + "u" * 40, "a" * 30, "more " * 10)
        assert policy.choose(prefix_keys(turn2, CFG), IDLE) == chosen[i]


def test_an_overloaded_replica_is_bypassed_and_an_unhealthy_one_never_chosen():
    policy = PrefixAware(2, abs_margin=2, rel_margin=1.5)
    keys = prefix_keys(_chat("p" * 64), CFG)
    home = policy.choose(keys, IDLE)
    loads = [ReplicaLoad(), ReplicaLoad()]
    loads[home] = ReplicaLoad(in_flight=10)
    moved = policy.choose(keys, loads)
    assert moved != home and policy.stats.rebalanced == 1
    assert policy.choose(keys, IDLE) == moved  # the table follows the request
    loads = [ReplicaLoad(), ReplicaLoad()]
    loads[moved] = ReplicaLoad(healthy=False)
    assert policy.choose(keys, loads) == 1 - moved
    with pytest.raises(RuntimeError, match="healthy"):
        policy.choose(keys, [ReplicaLoad(healthy=False)] * 2)


def test_round_robin_least_load_and_the_policy_names():
    rr = RoundRobin()
    assert [rr.choose([], IDLE) for _ in range(4)] == [0, 1, 0, 1]
    loads = [ReplicaLoad(in_flight=3), ReplicaLoad(in_flight=1, waiting=1), ReplicaLoad(1)]
    assert least_loaded(loads) == 2 and LeastLoad().choose([], loads) == 2
    assert least_loaded([ReplicaLoad(kv_usage=0.5), ReplicaLoad(kv_usage=0.1)]) == 1
    assert isinstance(make_policy("prefix", 2), PrefixAware)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="num_replicas"):
        PrefixAware(0)


class _LRUCache:
    """A replica's prefix cache as blocks keyed by prefix key, evicting the oldest."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()
        self.queries = self.hits = 0

    def serve(self, keys: list[bytes]) -> None:
        hit = 0
        while hit < len(keys) and keys[hit] in self.blocks:
            hit += 1
        self.queries += len(keys)
        self.hits += hit
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def _hit_rate(policy, caches: list[_LRUCache], requests: list[list[bytes]]) -> float:
    for keys in requests:
        caches[policy.choose(keys, [ReplicaLoad()] * len(caches)) if policy else 0].serve(keys)
    return sum(c.hits for c in caches) / sum(c.queries for c in caches)


def test_prefix_routing_hit_rate_on_multi_turn_chat_beats_round_robin():
    """24 conversations of 6 turns, interleaved at random; each replica caches 300 blocks,
    the single engine 600 (the whole fleet's cache in one)."""
    rng = random.Random(0)
    conversations = [[f"system {c} " + "s" * 100] for c in range(24)]
    order = [c for c in range(24) for _ in range(6)]
    rng.shuffle(order)
    requests = []
    for c in order:
        conversations[c] += ["a" * rng.randint(20, 80), "q" * rng.randint(20, 80)]
        requests.append(prefix_keys(_chat(*conversations[c]), CFG))
    one = _hit_rate(None, [_LRUCache(600)], requests)
    prefix = _hit_rate(PrefixAware(2), [_LRUCache(300), _LRUCache(300)], requests)
    rr = _hit_rate(RoundRobin(), [_LRUCache(300), _LRUCache(300)], requests)
    assert prefix >= 0.9 * one, (prefix, one)
    assert prefix >= 1.5 * rr, (prefix, rr)
