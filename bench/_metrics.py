"""Per-request timings -> throughput and latency figures; model FLOP/byte accounting; the
machine's own limits (a large matmul, a streaming copy) measured in the same process.

Shared by every engine of bench/throughput.py so that all of them are summarised the same way.
Times are seconds from the start of the timed run (perf_counter).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    """One request of a timed run.

    prompt_len / output_len: the tokens that count (static batching computes more: padding).
    arrival: when it was submitted (0 offline; its Poisson time otherwise).
    first_token: when its first output token reached the caller.
    last_useful_token: when its output_len-th token reached the caller (TPOT uses it).
    finish: when its result was complete (static batching: its whole batch's end).
    """

    prompt_len: int
    output_len: int
    arrival: float = 0.0
    first_token: float = float("nan")
    last_useful_token: float = float("nan")
    finish: float = float("nan")


@dataclass
class RunResult:
    """What one engine did on one dataset."""

    engine: str
    elapsed_s: float
    timings: list[RequestTiming]
    extra: dict = field(default_factory=dict)  # engine-specific counters (stats, compilations)

    def summary(self) -> dict:
        t = self.timings
        num_in = sum(r.prompt_len for r in t)
        num_out = sum(r.output_len for r in t)
        el = max(self.elapsed_s, 1e-9)
        ttft = [r.first_token - r.arrival for r in t]
        tpot = [
            (r.last_useful_token - r.first_token) / (r.output_len - 1)
            for r in t
            if r.output_len > 1
        ]
        e2e = [r.finish - r.arrival for r in t]
        out = {
            "engine": self.engine,
            "elapsed_s": self.elapsed_s,
            "num_requests": len(t),
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
            "requests_per_s": len(t) / el,
            "output_tokens_per_s": num_out / el,
            "total_tokens_per_s": (num_in + num_out) / el,
        }
        out.update(_percentiles("ttft_ms", ttft))
        out.update(_percentiles("tpot_ms", tpot))
        out.update(_percentiles("e2e_ms", e2e))
        out.update(self.extra)
        return out

    def timings_json(self) -> list[dict]:
        return [asdict(r) for r in self.timings]


def _percentiles(name: str, values: list[float]) -> dict:
    vals = np.asarray([v for v in values if np.isfinite(v)], np.float64) * 1e3
    if vals.size == 0:
        return {f"{name}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    return {
        f"{name}_mean": float(vals.mean()),
        f"{name}_p50": float(np.percentile(vals, 50)),
        f"{name}_p90": float(np.percentile(vals, 90)),
        f"{name}_p99": float(np.percentile(vals, 99)),
    }


# ---- model accounting -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The Llama-shaped dimensions the FLOP/byte model needs (glossary letters)."""

    num_layers: int  # L
    hidden: int  # D
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    intermediate: int  # F
    vocab: int  # V
    bytes_per_param: int = 4  # float32

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        heads = cfg["num_attention_heads"]
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
        )

    @property
    def layer_matmul_params(self) -> int:
        """Parameters every computed token multiplies with (q, k, v, o, gate, up, down)."""
        d, n, k, h, f = (
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
        )
        return self.num_layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def num_params(self) -> int:
        """All parameters (embedding and untied lm_head included, norms included)."""
        norms = (2 * self.num_layers + 1) * self.hidden
        return self.layer_matmul_params + 2 * self.lm_head_params + norms

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights one forward step streams once: layers and lm_head (the embedding is only
        gathered at T rows)."""
        return (self.layer_matmul_params + self.lm_head_params) * self.bytes_per_param

    def request_flops(self, prompt_len: int, output_len: int, cached: int = 0) -> float:
        """Useful FLOPs of one request: 2 x params per computed token, 2 x D x V per sampled
        token, and causal attention 4 x L x N x H x context per computed token.

        Computed tokens are positions cached .. prompt_len + output_len - 2 (the last sampled
        token is never fed back); a prefix-cache hit skips the first ``cached`` positions.
        """
        first, last = cached, prompt_len + output_len - 2  # computed positions, inclusive
        n = max(last - first + 1, 0)
        ctx_sum = (last + 1) * (last + 2) / 2 - first * (first + 1) / 2  # sum of (p + 1)
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * ctx_sum
        return 2.0 * self.layer_matmul_params * n + 2.0 * self.lm_head_params * output_len + attn

    def request_kv_read_bytes(self, prompt_len: int, output_len: int) -> float:
        """KV bytes a step-wise decode reads for one request: its context once per decode step
        (prefill reads are counted once, as a kernel streaming each sequence's pages would)."""
        ctx = np.arange(prompt_len, prompt_len + output_len - 1, dtype=np.float64) + 1
        return float(ctx.sum() + prompt_len) * self.kv_bytes_per_token


def utilization(
    shape: ModelShape,
    timings: list[RequestTiming],
    elapsed_s: float,
    num_steps: int | None,
    limits: dict,
    cached_tokens: int = 0,
) -> dict:
    """Achieved model FLOP/s and bytes/s against the machine's measured matmul and copy.

    FLOPs are the useful ones of ``request_flops`` (prefix hits subtract their tokens' layer
    matmuls only, an approximation). Bytes are weights once per step plus the KV reads of
    ``request_kv_read_bytes``; without a step count, no byte figure.
    """
    flops = sum(shape.request_flops(t.prompt_len, t.output_len) for t in timings)
    flops -= 2.0 * shape.layer_matmul_params * cached_tokens
    out = {"model_flops": flops, "model_flops_per_s": flops / elapsed_s}
    if limits.get("matmul_flops_per_s"):
        out["mfu_vs_matmul"] = out["model_flops_per_s"] / limits["matmul_flops_per_s"]
    if num_steps is not None:
        kv = sum(shape.request_kv_read_bytes(t.prompt_len, t.output_len) for t in timings)
        total = num_steps * shape.weight_bytes_per_step + kv
        out["model_bytes"] = total
        out["model_bytes_per_s"] = total / elapsed_s
        if limits.get("copy_bytes_per_s"):
            out["bandwidth_vs_copy"] = out["model_bytes_per_s"] / limits["copy_bytes_per_s"]
    return out


# ---- the machine's limits -------------------------------------------------------------------


def machine_limits(matmul_n: int = 2048, copy_mib: int = 256, reps: int = 5) -> dict:
    """The machine's limits, measured here and now (best of reps).

    matmul: float32 n^3 through jnp (2 n^3 FLOPs). copy: streaming over copy_mib MiB, one read
    and one write per element, both as jnp `x + 1` and as numpy's copyto; the faster of the two
    is the bandwidth limit (XLA's elementwise loop may not saturate memory).
    """
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (matmul_n, matmul_n), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 1), (matmul_n, matmul_n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm_s = _best_time(lambda: mm(a, b), reps)
    n = copy_mib * (1 << 20) // 4
    x = jnp.ones((n,), jnp.float32)
    add = jax.jit(lambda v: v + 1.0)
    jnp_s = _best_time(lambda: add(x), reps)
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    np_s = _best_time(lambda: np.copyto(dst, src), reps)
    nbytes = 2.0 * n * 4
    return {
        "matmul_n": matmul_n,
        "matmul_s": mm_s,
        "matmul_flops_per_s": 2.0 * matmul_n**3 / mm_s,
        "copy_mib": copy_mib,
        "copy_jnp_bytes_per_s": nbytes / jnp_s,
        "copy_numpy_bytes_per_s": nbytes / np_s,
        "copy_bytes_per_s": nbytes / min(jnp_s, np_s),
    }


def _best_time(fn, reps: int) -> float:
    def once() -> None:
        out = fn()
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()

    once()  # compile and first touch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best
