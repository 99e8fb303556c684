"""Online serving benchmark, in the spirit of `vllm bench serve`: jaxserve's OpenAI server and
vLLM's, one after the other in the same run, under Poisson arrivals over HTTP.

Workload: bench/throughput.py's ShareGPT-like set (bench/_datasets.py: lognormal lengths,
token-id prompts), each request a streaming /v1/completions call with ``ignore_eos: true`` and
``max_tokens`` = its output length, so both servers generate exactly the same tokens. Each
server is started as a subprocess on 127.0.0.1 (a free port), waited for on ``GET /health``,
warmed up with a few short requests, then driven at every request rate in turn:

    saturation   all requests sent at once (rate = inf), run first: its request throughput
                 sets the rates (default preset: fractions of jaxserve's, see --rate-fractions)
    rate r       request i sent at its arrival time of a seeded Poisson process of rate r
                 (bench/_jaxserve_runs.poisson_arrivals); the same arrivals for both servers
    search       then, per server, a bisection for the highest rate it sustains with p99 TTFT
                 <= 2 s (--search-steps runs between the grid's last passing and first failing
                 rate; sustained_rate below)

Every run sends prompts of its own: the same lengths (the same work) with other token ids
(_datasets.sharegpt_like's token_seed, from the run's key), identical for both servers at a
rate, so that no run reads a prefix cache that an earlier run filled (the workload has no
shared prefixes). The client (this process, aiohttp, as vLLM's `bench serve`: a third of
httpx's CPU per streamed chunk, which matters on a machine the servers share) runs one asyncio
task per request; every request and every run is bounded by a timeout. Measured per request,
from the moment its POST is sent:

    TTFT   until the first streamed chunk carrying a choice (its text may be empty)
    ITL    the gaps between consecutive choice chunks, each divided by the tokens per gap of
           that request ((completion_tokens - 1) / (chunks - 1)): equal to the plain gap when
           every chunk carries one token, which the reported tokens_per_chunk shows
    TPOT   (last chunk - first chunk) / (completion_tokens - 1)
    E2E    until the stream's end ([DONE])

Token counts come from the final ``usage`` chunk (``stream_options: {"include_usage": true}``),
never from the text. Per server and rate: p50 / p90 / p99 of each, request and output-token
throughput (over the time from the first send to the last finish). jaxserve's offline
``LLM.generate`` (same settings, in a subprocess, warmed up) runs the same requests, so that
served-at-saturation / offline throughput shows what serving costs: --overhead-repeats pairs of
an offline run and a saturation run, back to back, and the median of their ratios (the machine's
speed drifts between runs minutes apart by more than serving costs).

    python bench/serve.py                        # llama-57m, jaxserve + vLLM, ~30 min
    python bench/serve.py --preset queueing      # the same with max_num_seqs 32: a queue forms
    python bench/serve.py --preset tiny --vllm-python ''    # built-in tiny model, < 2 min
    python bench/serve.py --rates 0.5,1,2 --num-requests 64 --plot

Writes bench/results/serve.json (--output), and with --plot a PNG beside it (p99 TTFT and
output throughput against the rate). vLLM runs from its own interpreter (--vllm-python, a venv
with vLLM's CPU build; '' skips it, noted in the JSON). The benchmark model has no tokenizer:
both servers get the same word-level one (one word per id, written into bench/.cache), so that
every generated token streams as non-empty text and no server holds text back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _baselines  # noqa: E402
import _datasets  # noqa: E402
import throughput  # noqa: E402
from _jaxserve_runs import poisson_arrivals  # noqa: E402
from _machine import git_state, loadavg, machine  # noqa: E402
from _metrics import ModelShape, _percentiles  # noqa: E402

CACHE = HERE / ".cache"
RESULTS = HERE / "results"
DEFAULT_VLLM_PYTHON = throughput.DEFAULT_VLLM_PYTHON
SERVERS = ("jaxserve", "vllm")
SERVED_NAME = "bench"  # --served-model-name of both servers
TTFT_SLO_S = 2.0
WARM_UP_MAX_TOKENS = 8
GOAL_SERVED_OVER_OFFLINE = 0.90
GOAL_RATE_RATIO = 1.5
INF = float("inf")


@dataclass(frozen=True)
class ServePreset:
    """A model, engine limits, a request set and the rates that belong together."""

    model: str  # a bench/throughput.py preset (its checkpoint) or a built-in jaxserve model
    builtin: bool  # model is a jaxserve built-in name (no folder: vLLM cannot serve it)
    engine: dict  # block_size, num_kv_blocks (usable), max_num_seqs, ...
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)
    rates: tuple[float, ...] | None = None  # fixed rates (req/s); None: fractions
    rate_fractions: tuple[float, ...] = (0.5, 1.0, 2.0)
    servers: tuple[str, ...] = SERVERS
    output: str = "serve.json"
    # Saturation runs of jaxserve, each right after an offline run of the same requests: the
    # served / offline goal is the median of those pairs (the 2-core machine's speed drifts by
    # 10-20% between runs minutes apart, more than what serving costs).
    overhead_repeats: int = 3
    # Bisection runs per server for its sustained rate, after the grid (0: the grid alone).
    search_steps: int = 3


PRESETS = {
    # bench/throughput.py's default model (~57M params, fp32) and engine settings.
    "default": ServePreset(
        model="default",
        builtin=False,
        engine=dict(throughput.PRESETS["default"].engine),
        # 128 requests and four rates: both servers' runs take ~20 minutes on 2 busy cores.
        # Neither server queues below max_num_seqs (chunked prefill admits each arrival within
        # a step), so the rates reach well past saturation to find where p99 TTFT breaks.
        num_requests=128,
        rate_fractions=(0.5, 1.0, 2.0, 4.0),
    ),
    # The default model with a batch cap that queues: at 32 running sequences a server admits
    # arrivals only as others finish, so p99 TTFT grows once the rate passes what it sustains
    # (with 256 neither server queues and the TTFT goal's rate cannot tell them apart). Rates
    # from half to twice jaxserve's saturation rate, in steps fine enough to place that knee.
    "queueing": ServePreset(
        model="default",
        builtin=False,
        engine=dict(throughput.PRESETS["default"].engine, max_num_seqs=32),
        num_requests=96,
        rate_fractions=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        overhead_repeats=5,
        output="serve_queueing.json",
    ),
    # For tests/bench: the built-in demo model, a handful of short requests, one rate.
    "tiny": ServePreset(
        model="tiny-random-llama",
        builtin=True,
        engine=dict(  # few shapes to compile: T in {1, 16} x B in {1, 2} (bench's smoke)
            block_size=16,
            num_kv_blocks=32,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=32,
        ),
        num_requests=6,
        dataset_kw=dict(mean_input=8, mean_output=8, max_prompt_len=16, max_total_len=32),
        rates=(8.0,),
        servers=("jaxserve",),
        overhead_repeats=1,
        search_steps=0,
        output="serve_tiny.json",
    ),
}
TINY_VOCAB = 1024  # the built-in model's vocabulary


# ---- the model and its tokenizer -------------------------------------------------------------


def ensure_wordlevel_tokenizer(folder: Path, vocab_size: int, max_len: int) -> Path:
    """A word-level tokenizer of exactly vocab_size ids (<pad> <s> </s> <unk>, then "w3" ...),
    written once: every non-special id decodes to a word of its own, so each streamed token
    carries text on both servers. Both read tokenizer.json + tokenizer_config.json."""
    marker = folder / "bench_tokenizer.json"
    wanted = json.dumps({"vocab_size": vocab_size, "max_len": max_len, "kind": "wordlevel-v1"})
    if marker.exists() and marker.read_text() == wanted:
        return folder
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(wanted)
    return folder


@dataclass
class Model:
    name: str
    path: str  # the folder, or the built-in name
    tokenizer: str | None  # a tokenizer folder for both servers (None: the model's own)
    vocab_size: int
    shape: ModelShape | None  # None for a built-in model
    builtin: bool


def prepare_model(preset: ServePreset, cache: Path) -> Model:
    if preset.builtin:
        return Model(preset.model, preset.model, None, TINY_VOCAB, None, True)
    tp = throughput.PRESETS[preset.model]
    folder = throughput.ensure_checkpoint(tp, cache)
    cfg = json.loads((folder / "config.json").read_text())
    shape = ModelShape.from_hf_config(cfg)
    tok = ensure_wordlevel_tokenizer(
        cache / f"{tp.model_name}-wordlevel-tokenizer",
        shape.vocab,
        preset.engine["max_model_len"],
    )
    return Model(tp.model_name, str(folder), str(tok), shape.vocab, shape, False)


# ---- server processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess (its own process group), its log file and its health wait."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path) -> None:
        self.name, self.cmd, self.env, self.port, self.log_path = name, cmd, env, port, log_path
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(HERE.parent),
            start_new_session=True,
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll GET /health until 200; raise if the process exits or the time runs out.
        Returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was healthy:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(
                    f"{self.name} not healthy after {timeout_s:.0f} s:\n" + self.log_tail()
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> dict:
        """SIGINT (a clean shutdown), then SIGTERM and SIGKILL to its process group, each
        bounded. Returns how it ended."""
        out = {"signal": None, "returncode": None}
        if self.proc is None:
            return out
        steps = (
            (signal.SIGINT, grace_s, False),
            (signal.SIGTERM, 15, True),
            (signal.SIGKILL, 15, True),
        )
        for sig, wait_s, group in steps:
            if self.proc.poll() is not None:
                break
            out["signal"] = sig.name
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        # Children (vLLM's engine core and worker) left in its process group, if any.
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            time.sleep(1.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out["returncode"] = self.proc.poll()
        self._log.close()
        return out


def jaxserve_command(
    model: Model, engine: dict, port: int, compile_cache: Path, seed: int
) -> list[str]:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model.path]
    if model.tokenizer:
        cmd += ["--tokenizer", model.tokenizer]
    cmd += [
        "--dtype", "float32",
        "--block-size", str(engine["block_size"]),
        "--num-kv-blocks", str(engine["num_kv_blocks"] + 1),  # + jaxserve's null block
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--compilation-cache-dir", str(compile_cache),
        "--seed", str(seed),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return cmd


def vllm_command(python: str, model: Model, engine: dict, port: int, seed: int) -> list[str]:
    """vLLM's OpenAI server module (0.32: request logging is off by default, so no
    --disable-log-requests; the KV pool is sized in bytes to jaxserve's usable blocks)."""
    kv_bytes = engine["num_kv_blocks"] * engine["block_size"] * model.shape.kv_bytes_per_token
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model.path]
    if model.tokenizer:
        cmd += ["--tokenizer", model.tokenizer]
    cmd += [
        "--dtype", "float32",
        "--block-size", str(engine["block_size"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--kv-cache-memory-bytes", str(kv_bytes),
        "--seed", str(seed),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return cmd


# ---- the client ---------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request of a run; times are seconds from the run's start."""

    index: int
    prompt_len: int
    output_len: int  # asked for (max_tokens, ignore_eos)
    arrival: float  # scheduled
    start: float = math.nan  # when its POST was sent
    ttft: float = math.nan
    e2e: float = math.nan
    tpot: float = math.nan
    num_chunks: int = 0  # chunks carrying a choice
    num_empty_chunks: int = 0  # of those, with empty text
    completion_tokens: int | None = None  # from usage
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.completion_tokens == self.output_len


async def _stream_one(session, url: str, body: dict, rec: RequestRecord, times: list) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            rec.error = f"HTTP {resp.status}: {text[:300]}"
            return
        async for line in resp.content:  # one line of the event stream at a time
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                return
            choices = obj.get("choices")
            if choices:
                times.append(time.perf_counter())
                if not choices[0].get("text"):
                    rec.num_empty_chunks += 1
            usage = obj.get("usage")
            if usage:
                rec.completion_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
    rec.error = rec.error or "stream ended without [DONE]"


async def _one(client, url, body, rec, t0, timeout_s, itl_out: list) -> None:
    delay = t0 + rec.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    rec.start = start - t0
    times: list[float] = []
    try:
        await asyncio.wait_for(_stream_one(client, url, body, rec, times), timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"timed out after {timeout_s:.0f} s"
    except Exception as e:  # a failed request is recorded, not fatal
        rec.error = f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    rec.num_chunks = len(times)
    if times:
        rec.ttft = times[0] - start
    if rec.error is None:
        rec.e2e = end - start
        n = rec.completion_tokens or 0
        if n > 1 and len(times) > 1:
            rec.tpot = (times[-1] - times[0]) / (n - 1)
            per_gap = (n - 1) / (len(times) - 1)  # tokens per gap (1: one token a chunk)
            itl_out.extend(np.diff(times) / per_gap)


def _body(req: _datasets.BenchRequest, temperature: float) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _run_load(
    base_url: str,
    requests: list[_datasets.BenchRequest],
    arrivals: np.ndarray,
    *,
    temperature: float,
    request_timeout_s: float,
    run_timeout_s: float,
) -> tuple[list[RequestRecord], list[float], float]:
    """Every request at its arrival time (one task each). Returns (records, ITL samples (s),
    elapsed from the start to the last finish)."""
    url = f"{base_url}/v1/completions"
    records = [
        RequestRecord(i, r.prompt_len, r.output_len, float(a))
        for i, (r, a) in enumerate(zip(requests, arrivals, strict=True))
    ]
    itl: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)  # no connection cap: one per request in flight
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60.0)  # _one bounds each request
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        t0 = time.perf_counter() + 0.05  # every task is created before the first send
        tasks = [
            asyncio.ensure_future(
                _one(
                    client,
                    url,
                    _body(r, temperature),
                    rec,
                    t0,
                    request_timeout_s,
                    itl,
                )
            )
            for r, rec in zip(requests, records, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=30)
            for rec in records:
                if rec.error is None and not math.isfinite(rec.e2e):
                    rec.error = f"run timed out after {run_timeout_s:.0f} s"
    ends = [r.start + r.e2e for r in records if math.isfinite(r.e2e)]
    elapsed = max(ends) if ends else math.nan
    return records, itl, elapsed


def summarize(rate: float, records: list[RequestRecord], itl: list[float], elapsed: float) -> dict:
    done = [r for r in records if r.error is None]
    out_tokens = sum(r.completion_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    el = elapsed if elapsed and math.isfinite(elapsed) and elapsed > 0 else math.nan
    chunks = sum(r.num_chunks for r in done)
    s = {
        "rate": rate,
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "tokens_match": sum(r.ok for r in records),  # completion_tokens == asked
        "duration_s": elapsed,
        "requests_per_s": len(done) / el,
        "output_tokens_per_s": out_tokens / el,
        "total_tokens_per_s": (in_tokens + out_tokens) / el,
        "num_output_tokens": out_tokens,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "empty_text_chunks": sum(r.num_empty_chunks for r in done),
    }
    s.update(_percentiles("ttft_ms", [r.ttft for r in done]))
    s.update(_percentiles("itl_ms", itl))
    s.update(_percentiles("tpot_ms", [r.tpot for r in done]))
    s.update(_percentiles("e2e_ms", [r.e2e for r in done]))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        s["errors"] = errors[:5]
    return s


# ---- the offline reference (a subprocess) -----------------------------------------------------


def offline_worker(spec_path: str) -> None:
    """jaxserve's LLM.generate: built (warm-up on), one short untimed generate of the spec's
    warm-up requests, then one timed generate per line read from stdin (a JSON list of
    [prompt token ids, output length]). Prints "READY {json}" once built, then "RESULT {json}"
    per run (stdout carries nothing else)."""
    from jaxserve import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    e = spec["engine"]
    kw = {"tokenizer": spec["tokenizer"]} if spec["tokenizer"] else {}
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=e["block_size"],
        num_kv_blocks=e["num_kv_blocks"] + 1,
        max_num_seqs=e["max_num_seqs"],
        max_num_batched_tokens=e["max_num_batched_tokens"],
        max_model_len=e["max_model_len"],
        compilation_cache_dir=spec["compilation_cache_dir"],
        seed=spec["seed"],
        warmup=True,
        **kw,
    )
    startup = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=spec["temperature"])

    warm = spec["warmup"]
    llm.generate(
        [{"prompt_token_ids": p} for p, _ in warm],
        [params(n) for _, n in warm],
        use_tqdm=False,
    )
    print("READY " + json.dumps({"startup_s": startup}), flush=True)
    for line in sys.stdin:
        reqs = json.loads(line)
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in reqs],
            [params(n) for _, n in reqs],
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outs]
        num_out = sum(got)
        num_in = sum(len(p) for p, _ in reqs)
        result = {
            "elapsed_s": elapsed,
            "num_requests": len(reqs),
            "num_output_tokens": num_out,
            "tokens_match": sum(g == n for g, (_, n) in zip(got, reqs, strict=True)),
            "requests_per_s": len(reqs) / elapsed,
            "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_in + num_out) / elapsed,
        }
        print("RESULT " + json.dumps(result), flush=True)


class OfflineWorker:
    """The offline_worker subprocess: started once (its engine built and warmed up), then
    asked for timed runs of a request set, interleaved with the served runs."""

    def __init__(self, model: Model, engine: dict, warmup: list[tuple[list[int], int]], args):
        self.args = args
        self._tmp = tempfile.TemporaryDirectory(prefix="serve-offline-")
        spec_path = Path(self._tmp.name) / "spec.json"
        spec = {
            "model": model.path,
            "tokenizer": model.tokenizer,
            "engine": engine,
            "compilation_cache_dir": str(Path(args.cache) / "jax"),
            "seed": args.seed,
            "temperature": args.temperature,
            "warmup": warmup,
        }
        spec_path.write_text(json.dumps(spec))
        self.log = Path(args.log_dir) / "offline.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--offline-worker", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            cwd=str(HERE.parent),
            text=True,
        )
        self.startup_s = self._read("READY", args.startup_timeout)["startup_s"]

    def run(self, requests: list[_datasets.BenchRequest]) -> dict:
        """One timed LLM.generate of `requests`."""
        line = json.dumps([[r.prompt_token_ids, r.output_len] for r in requests])
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        result = self._read("RESULT", self.args.run_timeout)
        result["loadavg_after"] = loadavg()
        return result

    def _read(self, tag: str, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith(tag + " "):
            self.stop()
            why = f"no {tag} line within {timeout_s:.0f} s" if not ready else repr(line[:200])
            raise RuntimeError(f"offline worker: {why}:\n{self.log.read_text()[-3000:]}")
        return json.loads(line[len(tag) + 1 :])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        self._tmp.cleanup()


# ---- one benchmark invocation ---------------------------------------------------------------


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread of every process in the process
    group `pgid` (a server and its children), summed by thread name; {} where /proc is not."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:  # its process group
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    by_thread = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    by_thread = {k: v for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.05}
    return {"server": round(sum(by_thread.values()), 2), "server_by_thread": by_thread}


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _round_rate(x: float) -> float:
    """Two significant digits: rates that read well in the table."""
    return float(f"{x:.2g}")


class ServeBench:
    def __init__(self, args: argparse.Namespace, preset: ServePreset) -> None:
        self.args, self.preset = args, preset
        self.cache = Path(args.cache)
        self.model = prepare_model(preset, self.cache)
        self.num_requests = args.num_requests or preset.num_requests
        self.dataset = self._draw(None)  # the lengths every run shares (its summary)
        self._request_sets: dict[str, list[_datasets.BenchRequest]] = {}
        self.rates: list[float] | None = list(args.rates) if args.rates else None
        self.servers: dict[str, dict] = {}
        self.offline: dict | None = None
        self.offline_worker: OfflineWorker | None = None
        self.notes: list[str] = []
        self.load = {"start": loadavg()}
        self.wall_s: float | None = None

    # -- request sets --

    def _draw(self, token_seed: int | None) -> _datasets.Dataset:
        return _datasets.sharegpt_like(
            self.num_requests,
            self.model.vocab_size,
            seed=self.args.seed,
            token_seed=token_seed,
            **self.preset.dataset_kw,
        )

    def request_set(self, key: str) -> list[_datasets.BenchRequest]:
        """The requests of the run named `key`: the shared lengths with prompts of their own,
        the same for every server (see the module docstring)."""
        if key not in self._request_sets:
            entropy = [self.args.seed, zlib.crc32(key.encode())]
            token_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
            self._request_sets[key] = self._draw(token_seed).requests
        return self._request_sets[key]

    # -- stages --

    def run_all(self) -> None:
        a = self.args
        try:
            if a.offline:
                self._start_offline()
            for name in a.servers:
                self.servers[name] = self._serve(name)
                self.save(partial=True)
            if self.offline_worker is not None:  # no pairs were run: one offline run alone
                self._offline_run(_saturation_key(0))
        finally:
            self._stop_offline()
        self.load["end"] = loadavg()

    def _start_offline(self) -> None:
        print("offline: jaxserve LLM.generate (subprocess, warm-up on) ...", flush=True)
        warm = [[r.prompt_token_ids, r.output_len] for r in self._warm_up_requests()]
        try:
            worker = OfflineWorker(self.model, self.preset.engine, warm, self.args)
        except Exception as e:  # recorded; the served runs still go ahead
            print(f"offline: FAILED: {e!r}"[:2000], flush=True)
            self.offline = {"error": repr(e)[-2000:]}
            return
        self.offline_worker = worker
        self.offline = {"startup_s": worker.startup_s, "runs": []}
        print(f"  offline engine ready after {worker.startup_s:.0f} s", flush=True)

    def _offline_run(self, key: str) -> dict | None:
        """One timed offline run of request set `key`; the first one's numbers are also the
        offline figures."""
        if self.offline_worker is None:
            return None
        try:
            run = self.offline_worker.run(self.request_set(key))
        except Exception as e:
            print(f"offline: FAILED: {e!r}"[:2000], flush=True)
            self.offline["error"] = repr(e)[-2000:]
            self._stop_offline()
            return None
        run["request_set"] = key
        if not self.offline["runs"]:
            self.offline.update(run)
        self.offline["runs"].append(run)
        print(
            f"  offline  {run['elapsed_s']:6.1f} s {run['output_tokens_per_s']:7.1f} out tok/s",
            flush=True,
        )
        return run

    def _stop_offline(self) -> None:
        if self.offline_worker is not None:
            self.offline_worker.stop()
            self.offline_worker = None

    def _server_process(self, name: str) -> ServerProcess | str:
        """The server to start, or why it is skipped."""
        a, model, engine = self.args, self.model, self.preset.engine
        port = free_port()
        log = Path(a.log_dir) / f"{name}.log"
        if name == "jaxserve":
            cmd = jaxserve_command(model, engine, port, self.cache / "jax", a.seed)
            return ServerProcess(name, cmd, dict(os.environ), port, log)
        if model.builtin:
            return f"{model.path} is a jaxserve built-in model: no checkpoint folder for vLLM"
        version = _baselines.vllm_available(a.vllm_python)
        if version is None:
            return f"vllm not importable with --vllm-python {a.vllm_python!r}"
        self.vllm_version = version
        cmd = vllm_command(a.vllm_python, model, engine, port, a.seed)
        env = _baselines.vllm_env(self.cache / "vllm-shim", "INFO")
        return ServerProcess(name, cmd, env, port, log)

    def _serve(self, name: str) -> dict:
        a = self.args
        server = self._server_process(name)
        if isinstance(server, str):
            print(f"{name}: skipped: {server}", flush=True)
            self.notes.append(f"{name} skipped: {server}")
            return {"skipped": server}
        info: dict = {"command": server.cmd, "log": str(server.log_path), "runs": []}
        if name == "vllm":
            info["version"] = getattr(self, "vllm_version", None)
        print(f"{name}: starting on port {server.port} (log {server.log_path}) ...", flush=True)
        t0 = time.perf_counter()
        server.start()
        try:
            info["startup_s"] = server.wait_healthy(a.startup_timeout)
            print(f"  {name} healthy after {info['startup_s']:.0f} s", flush=True)
            self._warm_up(server)
            # Saturation first (jaxserve's within its pairs with the offline runs): the first
            # server's sets the rates when they are not fixed.
            if name == "jaxserve":
                self._saturation_pairs(server, info)
            if not info["runs"]:
                info["runs"].append(self._run_rate(server, INF))
            if self.rates is None:
                self.rates = self._choose_rates(info["runs"][0])
                print(f"  rates (req/s): {self.rates}", flush=True)
            info["runs"].extend(self._run_rate(server, r) for r in self.rates)
            self._search(server, info)
        except Exception as e:  # recorded (the other server still runs)
            print(f"{name}: FAILED: {e!r}"[:3000], flush=True)
            info["error"] = repr(e)[-3000:]
        finally:
            info["stop"] = server.stop()
            info["wall_s"] = time.perf_counter() - t0
            info["server_log_facts"] = _log_facts(server.log_tail(200_000))
        return info

    def _saturation_pairs(self, server: ServerProcess, info: dict) -> None:
        """The served / offline measurement: overhead_repeats pairs of an offline run and a
        saturation run, back to back; the first saturation run is the rate-inf run."""
        repeats = self.args.overhead_repeats
        if self.offline_worker is None or repeats < 1:
            return
        pairs = info["overhead_pairs"] = []
        for j in range(repeats):
            off = self._offline_run(_saturation_key(j))
            if off is None:
                break
            served = self._run_rate(server, INF, _saturation_key(j))
            if not info["runs"]:
                info["runs"].append(served)
            pairs.append(
                {
                    "offline_output_tokens_per_s": off["output_tokens_per_s"],
                    "served_output_tokens_per_s": served["output_tokens_per_s"],
                    "ratio": served["output_tokens_per_s"] / off["output_tokens_per_s"],
                }
            )
        self._stop_offline()  # its engine's memory is not needed for the rates

    def _choose_rates(self, saturation: dict) -> list[float]:
        base = saturation["requests_per_s"]
        if not base or not math.isfinite(base):
            raise RuntimeError("the saturation run measured no throughput: no rates to choose")
        self.rate_base = {"requests_per_s": base}
        return sorted({_round_rate(f * base) for f in self.args.rate_fractions})

    def _search(self, server: ServerProcess, info: dict) -> None:
        """Up to --search-steps runs bisecting the server's sustained rate (next_search_rate)."""
        for _ in range(self.args.search_steps):
            rate = next_search_rate(_by_rate(info["runs"]))
            if rate is None:
                break
            run = self._run_rate(server, rate)
            run["search"] = True
            info["runs"].append(run)

    def _warm_up_requests(self) -> list[_datasets.BenchRequest]:
        """Four short requests (at most WARM_UP_MAX_TOKENS each), prompts of their own."""
        return [
            replace(r, output_len=min(r.output_len, WARM_UP_MAX_TOKENS))
            for r in self.request_set("warm-up")[:4]
        ]

    def _warm_up(self, server: ServerProcess) -> None:
        """A few short requests, untimed (connections, first-request paths)."""
        warm = self._warm_up_requests()
        records, _, _ = asyncio.run(
            _run_load(
                server.base_url,
                warm,
                np.zeros(len(warm)),
                temperature=self.args.temperature,
                request_timeout_s=self.args.request_timeout,
                run_timeout_s=self.args.request_timeout,
            )
        )
        bad = [r.error for r in records if r.error]
        if bad:
            raise RuntimeError(f"{server.name}: warm-up requests failed: {bad[:2]}")

    def _run_rate(self, server: ServerProcess, rate: float, key: str | None = None) -> dict:
        """One run at `rate` of request set `key` (default: the first saturation set at inf,
        else the rate's own)."""
        a = self.args
        key = key or (_saturation_key(0) if rate == INF else f"rate-{rate:g}")
        requests = self.request_set(key)
        arrivals = poisson_arrivals(len(requests), rate, a.seed)
        load_before = loadavg()
        cpu_before, client_before = group_cpu_seconds(server.proc.pid), _own_cpu_seconds()
        records, itl, elapsed = asyncio.run(
            _run_load(
                server.base_url,
                requests,
                arrivals,
                temperature=a.temperature,
                request_timeout_s=a.request_timeout,
                run_timeout_s=a.run_timeout,
            )
        )
        s = summarize(rate, records, itl, elapsed)
        s["request_set"] = key
        s["loadavg_before"], s["loadavg_after"] = load_before, loadavg()
        s["cpu_s"] = _cpu_delta(cpu_before, group_cpu_seconds(server.proc.pid))
        s["cpu_s"]["client"] = _own_cpu_seconds() - client_before
        s["requests"] = [asdict(r) for r in records]
        print(
            f"  {server.name:8s} rate {_rate_str(rate):>5s}: {elapsed:6.1f} s "
            f"{s['output_tokens_per_s']:7.1f} out tok/s  ttft p99 {_ms(s['ttft_ms_p99'])} ms  "
            f"itl p99 {_ms(s['itl_ms_p99'])} ms  ok {s['tokens_match']}/{s['num_requests']}  "
            f"cpu server {s['cpu_s']['server']:.0f} s client {s['cpu_s']['client']:.0f} s  "
            f"load {load_before[0]}->{loadavg()[0]}",
            flush=True,
        )
        return s

    # -- reporting --

    def save(self, partial: bool = False) -> dict:
        report = self.report()
        report["partial"] = partial
        self.args.output.parent.mkdir(parents=True, exist_ok=True)
        self.args.output.write_text(json.dumps(_json_safe(report), indent=1))
        return report

    def report(self) -> dict:
        m = self.model
        report = {
            "preset": self.args.preset,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(self.load),
            "git": git_state(),
            "settings": {
                "model": {
                    "name": m.name,
                    "path": m.path,
                    "tokenizer": m.tokenizer or "the model's own",
                    "num_params": m.shape.num_params if m.shape else None,
                    "dtype": "float32",
                },
                "engine": self.preset.engine,
                "kv_note": "num_kv_blocks usable blocks on both: jaxserve --num-kv-blocks N+1 "
                "(its null block), vLLM --kv-cache-memory-bytes N x block_size x KV bytes/token",
                "dataset": self.dataset.summary(),
                "request_sets": "each run its own prompts: these lengths, tokens drawn with "
                "token_seed from the run's key (request_set of a run), the same on both servers",
                "num_requests": self.num_requests,
                "rates": self.rates,
                "rate_fractions": None if self.args.rates else list(self.args.rate_fractions),
                "rate_base": getattr(self, "rate_base", None),
                "temperature": self.args.temperature,
                "overhead_repeats": self.args.overhead_repeats,
                "search_steps": self.args.search_steps,
                "ignore_eos": True,
                "seed": self.args.seed,
                "request_timeout_s": self.args.request_timeout,
                "run_timeout_s": self.args.run_timeout,
                "ttft_slo_s": TTFT_SLO_S,
                "client": _client_version(),
                "measurement": "TTFT: POST sent -> first chunk with a choice; ITL: gaps between "
                "choice chunks / ((completion_tokens - 1) / (chunks - 1)); TPOT: (last - first "
                "chunk) / (completion_tokens - 1); E2E: POST sent -> [DONE]; tokens from the "
                "final usage chunk; throughput over first send -> last finish",
            },
            "offline": self.offline,
            "servers": self.servers,
            "notes": self.notes,
            "wall_s": self.wall_s,
        }
        report["comparison"] = compare(report)
        report["goals"] = goals(report)
        return report


def _log_facts(log: str) -> dict:
    """A few lines of a server log worth keeping: its KV size and warm-up."""
    facts = {}
    for key, pattern in (
        ("kv_cache", r"KV cache size:[^\n]*|KV blocks of[^\n]*"),
        ("warmup", r"warm-up:[^\n]*"),
        ("omp_threads", r"core ids=[^\n]*"),
    ):
        found = re.findall(pattern, log)
        if found:
            facts[key] = found[-1].strip()[:300]
    return facts


def _client_version() -> str:
    return f"aiohttp {aiohttp.__version__}"


def _saturation_key(j: int) -> str:
    return f"saturation-{j}"


def _by_rate(runs: list[dict]) -> dict[float, dict]:
    """Runs by rate; of several at one rate (the saturation pairs), the first."""
    out: dict[float, dict] = {}
    for r in runs:
        out.setdefault(r["rate"], r)
    return out


def _runs(report: dict, server: str) -> dict[float, dict]:
    info = report["servers"].get(server) or {}
    return _by_rate(info.get("runs", []))


def meets_slo(s: dict) -> bool:
    """Every request completed and p99 TTFT <= the SLO."""
    p99 = s["ttft_ms_p99"]
    return s["failed"] == 0 and p99 is not None and p99 <= TTFT_SLO_S * 1e3


def slo_bracket(runs: dict[float, dict]) -> tuple[float | None, float | None]:
    """(lo, hi): hi the lowest rate tested (inf included) that misses the SLO, lo the highest
    tested below hi that meets it; None where there is none."""
    missed = [rate for rate, s in runs.items() if not meets_slo(s)]
    hi = min(missed) if missed else None
    met = [rate for rate, s in runs.items() if meets_slo(s) and (hi is None or rate < hi)]
    return (max(met) if met else None), hi


def sustained_rate(runs: dict[float, dict]) -> float | None:
    """The highest rate tested at which the SLO holds, and holds at every lower rate tested (a
    noisy pass above a miss does not count)."""
    return slo_bracket(runs)[0]


SEARCH_REL_TOL = 0.03  # stop bisecting once the bracket is this narrow


def next_search_rate(runs: dict[float, dict]) -> float | None:
    """The next rate of the bisection for sustained_rate (three significant digits): the middle
    of slo_bracket, twice lo while only inf missed, half hi while nothing met; None once the
    bracket is narrower than SEARCH_REL_TOL, or nothing missed, or no finite rate was run."""
    lo, hi = slo_bracket(runs)
    if hi is None or (lo is None and not math.isfinite(hi)):
        return None  # met everywhere (nothing to find), or only all-at-once was run
    if lo is None:
        mid = hi / 2
    elif not math.isfinite(hi):
        mid = 2 * lo
    elif hi / lo - 1 <= SEARCH_REL_TOL:
        return None
    else:
        mid = (lo + hi) / 2
    mid = float(f"{mid:.3g}")
    if mid in runs or mid <= (lo or 0.0) or mid >= hi:
        return None  # rounding reached the bracket's ends
    return mid


def compare(report: dict) -> dict:
    js, vl = _runs(report, "jaxserve"), _runs(report, "vllm")
    out: dict = {
        "sustained_rate": {
            name: sustained_rate(runs) for name, runs in (("jaxserve", js), ("vllm", vl)) if runs
        },
        "per_rate": [],
    }
    for rate in sorted(set(js) & set(vl)):
        a, b = js[rate], vl[rate]
        row = {"rate": rate}
        for key in (
            "ttft_ms_p99",
            "itl_ms_p99",
            "ttft_ms_p50",
            "itl_ms_p50",
            "output_tokens_per_s",
        ):
            if a.get(key) is not None and b.get(key):
                row[f"{key}_jaxserve/vllm"] = a[key] / b[key]
        row["jaxserve_ttft_p99_no_worse"] = _no_worse(a, b, "ttft_ms_p99")
        row["jaxserve_itl_p99_no_worse"] = _no_worse(a, b, "itl_ms_p99")
        out["per_rate"].append(row)
    sat = js.get(INF)
    off = report.get("offline") or {}
    pairs = report["servers"].get("jaxserve", {}).get("overhead_pairs")
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        out["served_saturation_over_offline"] = float(np.median(ratios))
        out["served_saturation_over_offline_pairs"] = ratios
    elif sat and off.get("output_tokens_per_s"):
        out["served_saturation_over_offline"] = (
            sat["output_tokens_per_s"] / off["output_tokens_per_s"]
        )
    return out


def _no_worse(a: dict, b: dict, key: str) -> bool | None:
    if a.get(key) is None or b.get(key) is None:
        return None
    return a[key] <= b[key]


def goals(report: dict) -> list[dict]:
    """The issue's goals: value, threshold, and whether it holds (None: not measured)."""
    out = []

    def goal(text: str, value, threshold: float, higher: bool = True) -> None:
        holds = None
        if value is not None:
            holds = bool(value >= threshold if higher else value <= threshold)
        out.append(
            {
                "goal": text,
                "value": value,
                "threshold": threshold,
                "direction": ">=" if higher else "<=",
                "pass": holds,
            }
        )

    c = report["comparison"]
    goal(
        "jaxserve served output tok/s at saturation / offline LLM.generate (median of pairs)",
        c.get("served_saturation_over_offline"),
        GOAL_SERVED_OVER_OFFLINE,
    )
    rates = c["sustained_rate"]
    ratio = None
    if "jaxserve" in rates and "vllm" in rates:
        j, v = rates["jaxserve"], rates["vllm"]
        if v:
            ratio = (j or 0.0) / v
        elif j:
            ratio = INF  # vLLM met the SLO at no rate tested, jaxserve at some
    goal(
        f"sustained rate (p99 TTFT <= {TTFT_SLO_S:g} s there and below): jaxserve / vLLM",
        ratio,
        GOAL_RATE_RATIO,
    )
    for row in c["per_rate"]:
        r = _rate_str(row["rate"])
        goal(
            f"rate {r}: jaxserve p99 TTFT / vLLM's",
            row.get("ttft_ms_p99_jaxserve/vllm"),
            1.0,
            higher=False,
        )
        goal(
            f"rate {r}: jaxserve p99 ITL / vLLM's",
            row.get("itl_ms_p99_jaxserve/vllm"),
            1.0,
            higher=False,
        )
    return out


def _json_safe(x):
    """inf / nan -> "inf" / null (strict JSON)."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {(_rate_str(k) if isinstance(k, float) else k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _rate_str(rate) -> str:
    if rate in (INF, "inf"):
        return "inf"
    return f"{rate:g}"


def _ms(v) -> str:
    return f"{v:8.1f}" if v is not None else f"{'-':>8s}"


def _num(v, width: int = 6, digits: int = 2) -> str:
    if v is None:
        return f"{'-':>{width}s}"
    if v == INF or v == "inf":
        return f"{'inf':>{width}s}"
    return f"{v:{width}.{digits}f}"


def print_table(report: dict) -> None:
    _print_runs(report)
    _print_comparison(report)
    for note in report["notes"]:
        print(f"note: {note}")
    print("goals:")
    for g in report["goals"]:
        mark = {True: "OK  ", False: "MISS", None: " -- "}[g["pass"]]
        value = "not measured" if g["value"] is None else _num(g["value"], 1, 3).strip()
        print(f"  [{mark}] {g['goal']} {g['direction']} {g['threshold']:g}: {value}")


def _print_runs(report: dict) -> None:
    """The settings line and one row per server and rate run."""
    s = report["settings"]
    m = s["model"]
    params = f"{m['num_params'] / 1e6:.1f}M params, " if m["num_params"] else ""
    print(
        f"\nmodel {m['name']} ({params}fp32), {s['num_requests']} requests a rate "
        f"(ShareGPT-like: mean in {s['dataset']['prompt_len_mean']:.0f}, out "
        f"{s['dataset']['output_len_mean']:.0f} tokens), {report['machine']['cpus']} cores, "
        f"load avg start {report['machine']['loadavg']['start']} end "
        f"{report['machine']['loadavg'].get('end')}"
    )
    head = (
        f"{'server':8s} {'rate':>6s} {'ok':>7s} {'req/s':>6s} {'out tok/s':>9s} "
        f"{'ttft p50':>8s} {'ttft p99':>8s} {'itl p50':>8s} {'itl p99':>8s} "
        f"{'e2e p50':>8s} {'e2e p99':>8s} {'tok/chk':>7s}"
    )
    print(head + "\n" + "-" * len(head))
    for name, info in report["servers"].items():
        if info.get("skipped"):
            print(f"{name:8s} skipped: {info['skipped']}")
            continue
        runs = sorted(info.get("runs", []), key=lambda r: r["rate"])
        for r in runs:
            rate = _rate_str(r["rate"]) + ("*" if r.get("search") else "")
            print(
                f"{name:8s} {rate:>6s} "
                f"{r['tokens_match']:>3d}/{r['num_requests']:<3d} {_num(r['requests_per_s'])} "
                f"{_num(r['output_tokens_per_s'], 9, 1)} {_ms(r['ttft_ms_p50'])} "
                f"{_ms(r['ttft_ms_p99'])} {_ms(r['itl_ms_p50'])} {_ms(r['itl_ms_p99'])} "
                f"{_ms(r['e2e_ms_p50'])} {_ms(r['e2e_ms_p99'])} {_num(r['tokens_per_chunk'], 7)}"
            )
        if info.get("error"):
            print(f"{name:8s} FAILED: {info['error'][:300]}")
    print(
        "(times in ms; ok = requests that got exactly the tokens asked for; * a run of the "
        "sustained-rate search)"
    )


def _print_comparison(report: dict) -> None:
    """Served against offline, each server's sustained rate, and jaxserve / vLLM per rate."""
    off = report.get("offline") or {}
    c = report["comparison"]
    if off.get("output_tokens_per_s"):
        ratio = c.get("served_saturation_over_offline")
        pairs = c.get("served_saturation_over_offline_pairs") or []
        print(
            f"offline jaxserve LLM.generate: {off['output_tokens_per_s']:.1f} out tok/s "
            f"({off['requests_per_s']:.2f} req/s, first run); served at saturation / offline: "
            f"{_num(ratio, 1, 2).strip()}"
            + (f" (median of {' '.join(f'{r:.2f}' for r in pairs)})" if len(pairs) > 1 else "")
        )
    rates = c["sustained_rate"]
    print(
        f"sustained rate (p99 TTFT <= {TTFT_SLO_S:g} s there and at every lower rate run): "
        + ", ".join(f"{k} {_rate_str(v) if v is not None else 'none'}" for k, v in rates.items())
    )
    for row in c["per_rate"]:
        print(
            f"  rate {_rate_str(row['rate']):>5s}: jaxserve/vLLM p99 TTFT "
            f"{_num(row.get('ttft_ms_p99_jaxserve/vllm'), 5)}, p99 ITL "
            f"{_num(row.get('itl_ms_p99_jaxserve/vllm'), 5)}, out tok/s "
            f"{_num(row.get('output_tokens_per_s_jaxserve/vllm'), 5)}"
        )


# ---- plot -----------------------------------------------------------------------------------


def plot(report: dict, output: Path) -> Path:
    """p99 TTFT and output tok/s against the request rate, one line per server; the saturation
    run drawn at the right edge ("inf")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"jaxserve": "#1f77b4", "vllm": "#d62728"}
    finite = [
        r["rate"]
        for info in report["servers"].values()
        for r in info.get("runs", [])
        if r["rate"] not in (INF, "inf")
    ]
    grid = [r for r in report["settings"]["rates"] or [] if r not in (INF, "inf")]
    inf_x = (max(finite) * 1.3) if finite else 1.0
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, info in report["servers"].items():
        runs = info.get("runs") or []
        if not runs:
            continue
        pts = sorted(((inf_x if r["rate"] in (INF, "inf") else r["rate"]), r) for r in runs)
        xs = [x for x, _ in pts]
        ttft = [(r["ttft_ms_p99"] or math.nan) / 1e3 for _, r in pts]
        tput = [r["output_tokens_per_s"] or math.nan for _, r in pts]
        c = colors.get(name)
        ax_t.plot(xs, ttft, "o-", color=c, label=name)
        ax_p.plot(xs, tput, "o-", color=c, label=name)
    off = report.get("offline") or {}
    if off.get("output_tokens_per_s"):
        ax_p.axhline(off["output_tokens_per_s"], color="#1f77b4", ls=":", label="jaxserve offline")
    ax_t.axhline(TTFT_SLO_S, color="gray", ls="--", lw=1, label=f"{TTFT_SLO_S:g} s")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("p99 TTFT (s)")
    ax_p.set_ylabel("output tokens/s")
    for ax in (ax_t, ax_p):
        ax.set_xlabel("request rate (req/s); rightmost: all at once")
        ticks = sorted(set(grid)) + [inf_x]  # the search's rates are points between them
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["inf"])
        ax.grid(alpha=0.3)
        ax.legend()
    m = report["settings"]["model"]
    fig.suptitle(
        f"bench/serve.py: {m['name']}, {report['settings']['num_requests']} ShareGPT-like "
        f"requests a rate, {report['machine']['cpus']} CPU cores ({report['time']})",
        fontsize=10,
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


# ---- command line -------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    """The command line's arguments; a None default is the preset's (parse_args fills it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--servers", help=f"comma list of {','.join(SERVERS)} (preset's default)")
    p.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="interpreter with vLLM installed ('' skips vLLM)",
    )
    p.add_argument("--num-requests", type=int, help="requests a rate (preset's default)")
    p.add_argument(
        "--rates",
        type=_floats,
        help="comma list of request rates (req/s) after the saturation run (default: the "
        "preset's, else --rate-fractions of the first server's saturation req/s)",
    )
    p.add_argument("--rate-fractions", type=_floats, default=None)
    p.add_argument("--no-offline", dest="offline", action="store_false")
    p.add_argument(
        "--overhead-repeats",
        type=int,
        help="offline + saturation run pairs for the served / offline goal (preset's default)",
    )
    p.add_argument(
        "--search-steps",
        type=int,
        help="bisection runs per server for its sustained rate (preset's default; 0: none)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per request")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="seconds, per rate's run")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds, per server")
    p.add_argument("--cache", default=str(CACHE), help="checkpoints, tokenizer, compile cache")
    p.add_argument("--log-dir", help="server logs (default <cache>/serve-logs)")
    p.add_argument("--output", help="results JSON (default bench/results/<preset file>)")
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        help="write a PNG (default: the JSON's path with .png)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.servers = args.servers.split(",") if args.servers else list(preset.servers)
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    if args.rates is None and preset.rates is not None:
        args.rates = list(preset.rates)
    if args.rate_fractions is None:
        args.rate_fractions = list(preset.rate_fractions)
    if args.overhead_repeats is None:
        args.overhead_repeats = preset.overhead_repeats
    if args.search_steps is None:
        args.search_steps = preset.search_steps
    args.output = Path(args.output) if args.output else RESULTS / preset.output
    if args.plot is not None:
        args.plot = Path(args.plot) if args.plot else args.output.with_suffix(".png")
    args.log_dir = args.log_dir or str(Path(args.cache) / "serve-logs")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bench = ServeBench(args, PRESETS[args.preset])
    t0 = time.perf_counter()
    try:
        bench.run_all()
    finally:
        bench.wall_s = time.perf_counter() - t0
        report = bench.save()
    print_table(report)
    if args.plot is not None:
        try:
            print(f"plot: {plot(report, args.plot)}")
        except ImportError:
            print("plot: matplotlib is not installed (pip install matplotlib); no plot")
    print(f"wrote {args.output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--offline-worker":
        offline_worker(sys.argv[2])
    else:
        main()
