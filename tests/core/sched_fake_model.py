"""A deterministic fake model and runner for host-side scheduler tests (no jax).

The fake "KV cache" stores, at each slot, the (position, token id) that was computed there. The
fake model's next token is a hash of every previous token *read back from that cache through the
block table*, so a wrong block table, a missed copy-on-write, a bad prefix hit or a clobbered
shared block changes the output (or trips an assertion) instead of going unnoticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.block_pool import BlockPool
from jaxserve.core.host_block_pool import HostTier
from jaxserve.core.kv_cache_utils import extend_block_hashes
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

VOCAB = 64
_MOD = (1 << 61) - 1


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: a rolling hash of the whole sequence, mod VOCAB."""
    h = 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
    return (h >> 7) % VOCAB


@dataclass
class _RunnerState:
    tokens: list[int]
    block_table: list[int]
    num_computed: int
    num_prompt: int
    params: SamplingParams


class FakeRunner:
    """Reads SchedulerOutput like a real runner: keeps per-request state, writes KV slots,
    applies block copies, samples at the end of each request's tokens.

    With ``pool`` given, it also checks that every written block is held by exactly one request
    and not in the prefix cache (a hashed block's contents never change). The host KV tier is
    a dict of slots; its copies run as the real runner's do: every device->host copy, then
    every host->device copy, then the copy-on-write copies, then the forward.
    """

    def __init__(self, num_blocks: int, block_size: int, pool: BlockPool | None = None) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.reqs: dict[str, _RunnerState] = {}
        self.pool = pool
        self.num_computed_tokens_total = 0  # tokens computed over all steps
        self.host: dict[int, list[tuple[int, int] | None]] = {}  # host slot -> block contents
        # KV connector: the store's blocks (FakeBlockStore), and the asynchronous loads being
        # read: req_id -> [job, steps left]. ``load_delay(job)`` gives a job's steps (>= 1),
        # ``load_cut(job)`` how many of its blocks it writes (fewer: a failed load).
        self.store: FakeBlockStore | None = None
        self.jobs: dict[str, list] = {}
        self.load_delay = lambda job: 1
        self.load_cut = lambda job: len(job.block_ids)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        bs = self.block_size
        offloaded = [(slot, self.slots[b * bs : (b + 1) * bs]) for b, slot in so.device_to_host]
        self.host.update(offloaded)
        for slot, dst in so.host_to_device:
            self.slots[dst * bs : (dst + 1) * bs] = self.host[slot]
        kv_loads = self._kv_connector(so)
        for src, dst in so.block_copies:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, new.req_id
            self.reqs[new.req_id] = _RunnerState(
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.num_prompt_tokens,
                new.sampling_params,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.reqs[cached.req_id]
            assert state.num_computed == cached.num_computed_tokens, cached
            state.block_table.extend(cached.new_block_ids)
        expected_order = [r.req_id for r in so.scheduled_new_reqs]
        expected_order += [r.req_id for r in so.scheduled_cached_reqs]
        assert list(so.num_scheduled_tokens) == expected_order
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        # Speculative drafts are input tokens of their positions, until verified.
        spec = so.scheduled_spec_decode_tokens
        for rid, drafts in spec.items():
            state = self.reqs[rid]
            assert state.num_computed == len(state.tokens) - 1, "drafts for a prefill"
            assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
            state.tokens.extend(drafts)
        # A forward pass writes all KV first, then attends: so write everything, then sample.
        for rid, num in so.num_scheduled_tokens.items():
            self._write(self.reqs[rid], num)
        out = self._sample(so)
        out.kv_loads = kv_loads
        return out

    def _kv_connector(self, so: SchedulerOutput) -> dict[str, int]:
        """The connector's loads, as the real runner's: jobs of finished requests dropped, new
        ones started, those whose delay ran out written (the first ``load_cut`` blocks), then
        the synchronous loads. Returns the jobs written: req_id -> blocks."""
        bs = self.block_size
        for rid in so.finished_req_ids:
            self.jobs.pop(rid, None)
        meta = so.kv_connector
        for job in meta.load_jobs if meta is not None else ():
            assert job.req_id not in self.jobs and job.req_id not in self.reqs, job
            self.jobs[job.req_id] = [job, self.load_delay(job)]
        done = {}
        for rid, entry in list(self.jobs.items()):
            entry[1] -= 1
            if entry[1] > 0:
                continue
            job = entry[0]
            del self.jobs[rid]
            num = min(self.load_cut(job), len(job.block_ids))
            for block_id, block_hash in zip(job.block_ids[:num], job.hashes[:num], strict=True):
                self.slots[block_id * bs : (block_id + 1) * bs] = self.store.blocks[block_hash]
            done[rid] = num
        for block_id, data in meta.loads if meta is not None else ():
            self.slots[block_id * bs : (block_id + 1) * bs] = data
        return done

    def _write(self, state: _RunnerState, num: int) -> None:
        bs = self.block_size
        start = state.num_computed
        assert num >= 1 and start + num <= len(state.tokens), (start, num, len(state.tokens))
        for pos in range(start, start + num):
            block_id = state.block_table[pos // bs]
            assert block_id != 0, "wrote into the null block"
            if self.pool is not None:
                block = self.pool.blocks[block_id]
                assert block.ref_cnt == 1, f"write into shared {block}"
                assert block.block_hash is None, f"write into cached {block}"
            self.slots[block_id * bs + pos % bs] = (pos, state.tokens[pos])
        state.num_computed += num
        self.num_computed_tokens_total += num

    def _read(self, state: _RunnerState, num_tokens: int | None = None) -> list[int]:
        bs = self.block_size
        out = []
        for pos in range(len(state.tokens) if num_tokens is None else num_tokens):
            entry = self.slots[state.block_table[pos // bs] * bs + pos % bs]
            assert entry == (pos, state.tokens[pos]), (pos, entry, state.tokens[pos])
            out.append(entry[1])
        return out

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        mro = ModelRunnerOutput()
        for rid, num in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            if state.params.prompt_logprobs is not None:
                start = state.num_computed - num
                entries = [
                    TokenLogprobs([state.tokens[p + 1]], [-1.0], [1])
                    for p in range(start, state.num_computed)
                    if p + 1 < state.num_prompt
                ]
                if entries:
                    mro.prompt_logprobs[rid] = entries
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            if state.num_computed < len(state.tokens):
                continue  # mid-prefill: nothing to sample
            tokens = self._verify(state, drafts)
            mro.req_ids.append(rid)
            mro.sampled_token_ids.append(tokens)
            if state.params.logprobs is not None:
                mro.logprobs[rid] = [TokenLogprobs([t], [-0.5], [1]) for t in tokens]
        return mro

    def _verify(self, state: _RunnerState, drafts: list[int]) -> list[int]:
        """The tokens a step emits: the model's next token after each accepted draft, up to
        the first that differs from its draft (the rejection rule for one-hot drafts). The
        rejected drafts leave the state: their KV is not computed for good."""
        known = len(state.tokens) - len(drafts)
        emitted = []
        for j in range(len(drafts) + 1):
            token = next_token(self._read(state, known + j))
            emitted.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
        num_rejected = len(drafts) - (len(emitted) - 1)
        del state.tokens[known:]
        state.tokens.extend(emitted)
        state.num_computed -= num_rejected
        return emitted


class FakeBlockStore:
    """The KV connector's store (core/kv_connector/store.py's interface) in a dict: block hash
    -> the fake cache's contents of that block ([(position, token)] * P)."""

    folder = "fake"

    def __init__(self) -> None:
        self.blocks: dict[bytes, list[tuple[int, int]]] = {}

    def put_prompt(self, tokens: Sequence[int], block_size: int) -> None:
        """Store every full block of ``tokens`` (as a producer that prefilled them)."""
        req = Request("producer", list(tokens), SamplingParams())
        for i, block_hash in enumerate(extend_block_hashes(req, block_size, len(tokens))):
            positions = range(i * block_size, (i + 1) * block_size)
            self.blocks[block_hash] = [(p, tokens[p]) for p in positions]

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def count_prefix(self, hashes: Sequence[bytes]) -> int:
        num = 0
        while num < len(hashes) and hashes[num] in self.blocks:
            num += 1
        return num

    def read_prefix(self, hashes: Sequence[bytes]) -> list:
        return [list(self.blocks[h]) for h in hashes[: self.count_prefix(hashes)]]

    def write(self, block_hash: bytes, data: list) -> None:
        self.blocks[block_hash] = data


def reference_output(
    prompt: Sequence[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int] = frozenset(),
    max_num_tokens: int | None = None,
) -> tuple[list[int], str]:
    """What the fake model gives one request alone, with the scheduler's stop rules.

    ``max_num_tokens`` caps prompt + outputs (max_model_len / pool limit); default: none.
    """
    tokens = list(prompt)
    outputs: list[int] = []
    limit = len(prompt) + params.max_tokens
    if max_num_tokens is not None:
        limit = max(min(limit, max_num_tokens), len(prompt) + 1)
    stops = params.all_stop_token_ids | (frozenset() if params.ignore_eos else eos_token_ids)
    while True:
        token = next_token(tokens)
        tokens.append(token)
        outputs.append(token)
        if token in stops and len(outputs) >= params.min_tokens:
            return outputs, "stop"
        if len(tokens) >= limit:
            return outputs, "length"


def make_request(
    req_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    *,
    arrival_time: float = 0.0,
    priority: int = 0,
    eos: frozenset[int] = frozenset(),
    **params: object,
) -> Request:
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        eos_token_ids=eos,
        arrival_time=arrival_time,
        priority=priority,
    )


def check_invariants(sched: Scheduler, lookahead: int = 0) -> None:
    """docs/architecture.md, checked on the live structures. ``lookahead``: the slots a table
    may hold past its computed tokens (speculative decoding: k for rejected drafts, plus the
    scheduler's lookahead slots)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders = [0] * pool.num_blocks
    loading = sched.remote.loading
    for rid, table in kv.req_to_blocks.items():
        req = sched.requests[rid]
        for block in table:
            holders[block.block_id] += 1
        if rid in loading:  # holds its hits and the blocks being loaded; nothing computed yet
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req
            continue
        assert req.status == RequestStatus.RUNNING, req
        num_needed = -(-req.num_computed_tokens // kv.block_size)
        # Tokens of steps in flight (async scheduling) have their slots too.
        most = -(-(req.num_computed_tokens + req.num_inflight_tokens + lookahead) // kv.block_size)
        assert num_needed <= len(table) <= most, (req, len(table))
    assert holders[0] == 0 and pool.null_block.ref_cnt == 0
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks()
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    num_held = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert len(free) + num_held == pool.num_usable_blocks
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    running_ids = {r.request_id for r in sched.running}
    waiting_ids = {r.request_id for r in sched.waiting}
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    assert not running_ids & waiting_ids and not (running_ids | waiting_ids) & set(loading)
    assert running_ids | waiting_ids | set(loading) == set(sched.requests)
    assert set(kv.req_to_blocks) <= running_ids | set(loading)
    assert set(loading) <= set(kv.req_to_blocks) and set(sched.remote.ready) <= set(loading)
    keys = [sched.sort_key(r) for r in sched.running]
    assert keys == sorted(keys)
    for req in sched.waiting:
        if not kv.is_swapped(req.request_id):
            assert req.num_computed_tokens == 0, req
    if sched.host.pool is not None:
        check_host_invariants(sched)


def check_host_invariants(sched: Scheduler) -> None:
    """Every host slot in exactly one state (free, cached in the LRU, pinned), the hash map
    consistent, pins counted by the swapped-out requests, no copy pending between steps."""
    kv = sched.kv_cache_manager
    host = sched.host.pool
    assert not host.locked and not host.device_to_host and not host.host_to_device
    free, lru = set(host.free), set(host.lru)
    pinned = {s for s in range(host.num_blocks) if host.pins[s] > 0}
    assert len(free) == len(host.free)
    assert not free & lru and not free & pinned and not lru & pinned
    assert free | lru | pinned == set(range(host.num_blocks))
    assert all(host.slot_hash[s] is None for s in free)
    assert all(host.slot_hash[s] is not None for s in lru)
    hashed = {s for s in range(host.num_blocks) if host.slot_hash[s] is not None}
    assert {host.hash_to_slot[h] for h in host.hash_to_slot} == hashed
    assert all(host.slot_hash[s] == h for h, s in host.hash_to_slot.items())
    holders = [0] * host.num_blocks
    for rid, slots in kv.swap.swapped.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.PREEMPTED and req in list(sched.waiting), req
        assert rid not in kv.req_to_blocks
        assert len(slots) == -(-req.num_computed_tokens // kv.block_size) > 0, req
        for slot in slots:
            holders[slot] += 1
    assert holders == host.pins


def check_all_free(sched: Scheduler) -> None:
    """Everything ended: no request, no held block, every block free."""
    pool = sched.kv_cache_manager.block_pool
    assert not sched.requests and not sched.running and len(sched.waiting) == 0
    assert not sched.remote.loading and not sched.kv_cache_manager.remote.pending
    assert not sched.kv_cache_manager.req_to_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert sched.get_stats()["num_free_kv_blocks"] == sched.get_stats()["num_usable_kv_blocks"]


def run_to_completion(
    sched: Scheduler,
    runner: FakeRunner,
    *,
    max_steps: int = 10_000,
    check: bool = True,
) -> dict[str, EngineCoreOutput]:
    """Step until no request is left; returns req_id -> a merged EngineCoreOutput (all tokens,
    the final finish reason)."""
    results: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)):
            merge_output(results, out)
        if check:
            check_invariants(sched)
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    return results


def merge_output(results: dict[str, EngineCoreOutput], out: EngineCoreOutput) -> None:
    acc = results.setdefault(out.req_id, EngineCoreOutput(out.req_id, []))
    assert acc.finish_reason is None, f"output after finish for {out.req_id}"
    acc.new_token_ids = acc.new_token_ids + list(out.new_token_ids)
    acc.finish_reason = out.finish_reason
    acc.stop_reason = out.stop_reason
    acc.num_cached_tokens = out.num_cached_tokens


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    max_model_len: int = 256,
    caching: bool = True,
    policy: str = "fcfs",
    num_host_blocks: int = 0,
    preemption_mode: str = "recompute",
) -> tuple[Scheduler, FakeRunner]:
    """A scheduler and a fake runner over the same pool; ``num_host_blocks`` > 0 adds a host
    KV tier (its GiB figure is nominal: the host tier's size is the block count)."""
    host = HostTier(num_host_blocks, block_bytes=1) if num_host_blocks else None
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            policy=policy,
        ),
        CacheConfig(
            block_size=block_size,
            enable_prefix_caching=caching,
            kv_offloading_size=1.0 if num_host_blocks else 0.0,
            preemption_mode=preemption_mode,
        ),
        num_blocks,
        host,
    )
    return sched, FakeRunner(num_blocks, block_size, sched.kv_cache_manager.block_pool)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step, with the invariants checked after it."""
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so))
    check_invariants(sched)
    return so, outs
