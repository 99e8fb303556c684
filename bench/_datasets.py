"""Synthetic request sets for bench/throughput.py, in the spirit of `vllm bench throughput`.

Every dataset is a list of token-id prompts with an exact output length each (requests run with
``ignore_eos`` so that every engine generates exactly that many tokens). Token ids are drawn
uniformly from [FIRST_ID, vocab_size), away from the special ids 0..2 of the tiny checkpoints.

    sharegpt  lognormal input and output lengths (means ~160 and ~340 tokens), clipped to
              input <= 1024 and input + output <= 2048 (ShareGPT's usual filter)
    random    fixed lengths, each drawn uniformly from [len * (1 - r), len * (1 + r)]
    prefix    a few shared prefixes, each request = one prefix + its own random suffix,
              shuffled (vLLM's "prefix repetition" set)

A Dataset also carries ``ideal_prefix_hit_tokens``: the prompt tokens an ideal prefix cache
skips when requests are admitted one after another, i.e. the full shared-prefix blocks of every
request except the first of each prefix. It is the yardstick for the measured hit rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FIRST_ID = 3  # 0 = pad, 1 = bos, 2 = eos in the tiny checkpoints
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
MIN_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # exact number of tokens to generate

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Dataset:
    name: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)  # how it was drawn, for the JSON
    ideal_prefix_hit_tokens: int = 0  # see the module docstring

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def ideal_prefix_hit_rate(self) -> float:
        return self.ideal_prefix_hit_tokens / max(self.num_prompt_tokens, 1)

    def summary(self) -> dict:
        ins = [r.prompt_len for r in self.requests]
        outs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "params": self.params,
            "prompt_len_mean": float(np.mean(ins)),
            "prompt_len_max": int(max(ins)),
            "output_len_mean": float(np.mean(outs)),
            "output_len_max": int(max(outs)),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ideal_prefix_hit_rate": self.ideal_prefix_hit_rate,
        }


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab_size, size=n).tolist()


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    # mean of a lognormal = exp(mu + sigma^2 / 2): choose mu for the requested mean.
    mu = math.log(mean) - sigma**2 / 2
    return np.rint(rng.lognormal(mu, sigma, size=n)).astype(np.int64)


def sharegpt_like(
    num_requests: int,
    vocab_size: int,
    *,
    mean_input: float = 160.0,
    mean_output: float = 340.0,
    sigma_input: float = 0.9,
    sigma_output: float = 0.8,
    max_prompt_len: int = MAX_PROMPT_LEN,
    max_total_len: int = MAX_TOTAL_LEN,
    seed: int = 0,
    token_seed: int | None = None,
) -> Dataset:
    """ShareGPT-like lengths without the ShareGPT file: lognormal input and output lengths.

    Lengths are clipped (not resampled) to [MIN_LEN, max_prompt_len] and to a total of
    max_total_len, so the clipped means sit slightly below the requested ones; the summary
    reports the drawn means. ``token_seed`` draws the prompt tokens from a generator of their
    own: the same lengths (the same work) with other prompts, which no prefix cache has seen.
    """
    rng = np.random.default_rng(seed)
    ins = np.clip(
        _lognormal_lengths(rng, num_requests, mean_input, sigma_input), MIN_LEN, max_prompt_len
    )
    outs = _lognormal_lengths(rng, num_requests, mean_output, sigma_output)
    outs = np.clip(outs, MIN_LEN, max_total_len - ins)
    token_rng = rng if token_seed is None else np.random.default_rng(token_seed)
    requests = [
        BenchRequest(_tokens(token_rng, int(i), vocab_size), int(o))
        for i, o in zip(ins, outs, strict=True)
    ]
    params = dict(
        mean_input=mean_input,
        mean_output=mean_output,
        sigma_input=sigma_input,
        sigma_output=sigma_output,
        max_prompt_len=max_prompt_len,
        max_total_len=max_total_len,
        seed=seed,
        token_seed=token_seed,
    )
    return Dataset("sharegpt", requests, params)


def random_fixed(
    num_requests: int,
    vocab_size: int,
    *,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> Dataset:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)] (0: all equal)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        lo = max(1, math.floor(mean * (1 - range_ratio)))
        hi = max(lo, math.ceil(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num_requests)

    ins, outs = lengths(input_len), lengths(output_len)
    requests = [
        BenchRequest(_tokens(rng, int(i), vocab_size), int(o))
        for i, o in zip(ins, outs, strict=True)
    ]
    params = dict(input_len=input_len, output_len=output_len, range_ratio=range_ratio, seed=seed)
    return Dataset("random", requests, params)


def prefix_repetition(
    num_requests: int,
    vocab_size: int,
    *,
    num_prefixes: int = 4,
    prefix_len: int = 256,
    suffix_len: int = 256,
    output_len: int = 128,
    block_size: int = 32,
    seed: int = 0,
) -> Dataset:
    """num_prefixes shared prefixes, num_requests // num_prefixes requests each, shuffled.

    The ideal hit count assumes a block-granular cache: each request after the first of its
    prefix skips the prefix's full blocks (prefix_len rounded down to block_size).
    """
    if num_requests < num_prefixes:
        raise ValueError(f"num_requests ({num_requests}) must be >= num_prefixes ({num_prefixes})")
    rng = np.random.default_rng(seed)
    per_prefix = num_requests // num_prefixes
    requests = []
    for _ in range(num_prefixes):
        prefix = _tokens(rng, prefix_len, vocab_size)
        for _ in range(per_prefix):
            requests.append(BenchRequest(prefix + _tokens(rng, suffix_len, vocab_size), output_len))
    order = rng.permutation(len(requests))
    requests = [requests[i] for i in order]
    shared = (prefix_len // block_size) * block_size
    ideal = (per_prefix - 1) * num_prefixes * shared
    params = dict(
        num_prefixes=num_prefixes,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        output_len=output_len,
        block_size=block_size,
        seed=seed,
    )
    return Dataset("prefix", requests, params, ideal_prefix_hit_tokens=ideal)


def build(name: str, num_requests: int, vocab_size: int, block_size: int, **kw) -> Dataset:
    """Dataset by name ("sharegpt" | "random" | "prefix"); kw are that builder's options."""
    if name == "sharegpt":
        return sharegpt_like(num_requests, vocab_size, **kw)
    if name == "random":
        return random_fixed(num_requests, vocab_size, **kw)
    if name == "prefix":
        return prefix_repetition(num_requests, vocab_size, block_size=block_size, **kw)
    raise ValueError(f"unknown dataset {name!r}; choose sharegpt, random or prefix")
