"""SampleFanOut: one user request as the scheduler's requests, one per sample (n > 1 is
parallel sampling: n requests, the first the parent whose blocks the others fork).

Each sample gets a scheduler id unique by construction (a counter: no user id can collide with
another request's sample; the user id rides along for logs), its own seed (the request's for
the first, mixed from it for the others: ``mix_seed``; a fresh one from the engine's seed when
the request has none), its own matcher state where the request has constraints, and only the
first asks for prompt logprobs. Host side, no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.request_constraints import ConstraintSpec

_MASK63 = (1 << 63) - 1


def mix_seed(seed: int, index: int) -> int:
    """A distinct 63-bit seed for child `index` of a seeded n > 1 request (splitmix64)."""
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class SampleFanOut:
    """Makes the scheduler requests of user requests (see the module docstring).

    Args:
        seed: the engine's seed (ModelConfig.seed): where the seeds of unseeded requests come
            from.
        eos_token_ids: the model's, given to every request.
    """

    def __init__(self, seed: int | None, eos_token_ids: frozenset[int]) -> None:
        self._seed_rng = np.random.default_rng(seed)
        self._num_added = itertools.count()
        self._eos_token_ids = eos_token_ids

    def engine_ids(self, request_id: str, n: int) -> list[str]:
        """The scheduler ids of a request's n samples."""
        k = next(self._num_added)
        return [f"{request_id}#{k}.{i}" for i in range(n)]

    def requests(
        self,
        engine_ids: list[str],
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        now: float,
        constraints: ConstraintSpec | None = None,
    ) -> list[Request]:
        """One Request per id of ``engine_ids`` (engine_ids(request_id, params.n))."""
        base = params.seed
        if base is None:
            base = int(self._seed_rng.integers(0, _MASK63, dtype=np.int64))
        requests = []
        for i, engine_id in enumerate(engine_ids):
            child = params
            if params.n > 1:
                child = dataclasses.replace(
                    params, n=1, prompt_logprobs=params.prompt_logprobs if i == 0 else None
                )
            requests.append(
                Request(
                    engine_id,
                    token_ids,
                    child,
                    eos_token_ids=self._eos_token_ids,
                    arrival_time=now,
                    priority=priority,
                    seed=base if i == 0 else mix_seed(base, i),
                    constraints=None if constraints is None else constraints.new_state(),
                )
            )
        return requests
