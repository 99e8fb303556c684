"""bench/serve.py --data-parallel-size N and --disagg: jaxserve beyond one engine, each
comparison side by side in one run.

--data-parallel-size N  a multi-turn chat workload (conversations of several turns, each turn's
    prompt its previous turn's prompt, an answer and a new user message; the conversations
    concurrent, each one's turns in order, each turn after a user's pause: ``--think-time``
    seconds on average, exponential, the same pauses in every run; without them the
    conversations would move in lockstep and round-robin would send an even number of them to
    the same replica turn after turn, by accident) against one engine holding N replicas' KV blocks
    and against N replicas (``jaxserve serve --data-parallel-size N``) routed by prefix and by
    round-robin: the prefix-cache hit rate (of the replicas together, from /metrics), output
    tokens/s and TTFT of each.
--disagg  decodes streaming while a burst of long prompts arrives, against one colocated server
    and against a producer and a consumer (``--kv-transfer-config``) behind ``jaxserve router``:
    the decodes' inter-token latency and the burst's TTFT, once per ``--kv-connectors`` entry
    (shared_storage: blocks through /dev/shm; jax_transfer: device to device, the router
    passing kv_transfer_params), side by side. The servers share this machine's
    cores: on a 2-core machine both roles compete for the same cores, which disaggregation is
    meant to avoid, so the numbers show this machine as much as the design.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _serve_load import RequestRecord, _stream_one  # noqa: E402
from _serve_presets import SERVED_NAME  # noqa: E402
from _serve_servers import ServerProcess, free_port, jaxserve_command, prepare_model  # noqa: E402

# The built-in model's engine for these runs: long enough for several turns, few shapes.
BUILTIN_ENGINE = dict(
    block_size=8, num_kv_blocks=48, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
)
NUM_TURNS = 6


def _engine(preset) -> dict:
    return dict(BUILTIN_ENGINE) if preset.builtin else dict(preset.engine)


def _server(name, model, engine, args, extra: list[str]) -> ServerProcess:
    port = free_port()
    cmd = jaxserve_command(model, engine, port, Path(args.cache) / "jax", args.seed) + extra
    log = Path(args.log_dir) / f"fleet-{name}.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return ServerProcess(name, cmd, env, port, log)


def _percentiles(values: list[float]) -> dict:
    """p50 / p90 / p99 of the finite values, in seconds ({} when there are none)."""
    vals = np.asarray([v for v in values if np.isfinite(v)], np.float64)
    if vals.size == 0:
        return {}
    return {f"p{q}": float(np.percentile(vals, q)) for q in (50, 90, 99)}


def _metric_sum(text: str, name: str) -> float:
    """The samples of ``name`` without a replica label (a front's sums; a server's own)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and 'replica="' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


# ---- data parallel ---------------------------------------------------------------------------


def conversations(num: int, engine: dict, vocab: int, seed: int) -> list[list[tuple[list, int]]]:
    """``num`` conversations of NUM_TURNS turns: each a (prompt token ids, max_tokens) list."""
    rng = np.random.default_rng(seed)
    budget = engine["max_model_len"] - 8
    user = max(4, budget // (NUM_TURNS * 3))
    answer = user
    convs = []
    for _ in range(num):
        history: list[int] = []
        turns = []
        for _ in range(NUM_TURNS):
            history = history + rng.integers(3, vocab, user).tolist()
            turns.append((list(history), answer))
            history = history + rng.integers(3, vocab, answer).tolist()  # the "answer"
        convs.append(turns)
    return convs


def think_times(num: int, mean_s: float, seed: int) -> list[list[float]]:
    """Each conversation's pause before each of its turns (exponential, mean ``mean_s``)."""
    rng = np.random.default_rng(seed + 2)
    return [(rng.exponential(mean_s, NUM_TURNS) if mean_s > 0 else np.zeros(NUM_TURNS)).tolist()
            for _ in range(num)]  # fmt: skip


async def _conversation(session, url: str, turns, pauses, records: list) -> None:
    for (prompt, max_tokens), pause in zip(turns, pauses, strict=True):
        await asyncio.sleep(pause)
        rec = RequestRecord(len(records), len(prompt), max_tokens, 0.0)
        records.append(rec)
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        times: list[float] = []
        start = time.perf_counter()
        await _stream_one(session, url, body, rec, times)
        if times:
            rec.ttft = times[0] - start


async def _drive(url: str, convs, pauses) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                _conversation(session, url, t, p, records)
                for t, p in zip(convs, pauses, strict=True)
            )
        )
        return records, time.perf_counter() - t0


def _dp_run(name: str, url: str, convs, pauses) -> dict:
    records, wall = asyncio.run(_drive(f"{url}/v1/completions", convs, pauses))
    text = _get(f"{url}/metrics")
    queries = _metric_sum(text, "jaxserve:prefix_cache_queries_total")
    hits = _metric_sum(text, "jaxserve:prefix_cache_hits_total")
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "name": name,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "output_tok_s": tokens / wall,
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "wall_s": wall,
    }


def run_data_parallel(args, preset) -> dict:
    """One engine with N replicas' blocks, then N replicas by prefix, then by round-robin."""
    n = args.data_parallel_size
    model = prepare_model(preset, Path(args.cache))
    engine = _engine(preset)
    convs = conversations(args.conversations, engine, model.vocab_size, args.seed)
    pauses = think_times(len(convs), args.think_time, args.seed)
    one = dict(engine, num_kv_blocks=engine["num_kv_blocks"] * n)
    configs = [
        ("one-engine", one, []),
        ("prefix", engine, ["--data-parallel-size", str(n), "--routing", "prefix"]),
        ("round_robin", engine, ["--data-parallel-size", str(n), "--routing", "round_robin"]),
    ]
    runs = []
    for name, eng, extra in configs:
        server = _server(name, model, eng, args, extra)
        server.start()
        try:
            server.wait_healthy(args.startup_timeout)
            runs.append(_dp_run(name, server.base_url, convs, pauses))
        finally:
            server.stop()
    by = {r["name"]: r for r in runs}
    ratios = {
        "hit_rate_prefix_over_one_engine": _ratio(by, "prefix", "one-engine", "prefix_hit_rate"),
        "hit_rate_prefix_over_round_robin": _ratio(
            by, "prefix", "round_robin", "prefix_hit_rate"
        ),  # fmt: skip
        "tok_s_prefix_over_round_robin": _ratio(by, "prefix", "round_robin", "output_tok_s"),
    }
    return {
        "mode": "data_parallel",
        "replicas": n,
        "engine": engine,
        "conversations": len(convs),
        "turns": NUM_TURNS,
        "think_time_s": args.think_time,
        "runs": runs,
        "ratios": ratios,
    }


def _ratio(by: dict, a: str, b: str, key: str) -> float | None:
    if a in by and b in by and by[b][key]:
        return by[a][key] / by[b][key]
    return None


# ---- disaggregated prefill -------------------------------------------------------------------


async def _timed_stream(session, url: str, prompt, max_tokens: int, out: dict) -> None:
    rec = RequestRecord(0, len(prompt), max_tokens, 0.0)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    times: list[float] = []
    start = time.perf_counter()
    await _stream_one(session, url, body, rec, times)
    out.setdefault("errors", []).extend([rec.error] if rec.error else [])
    if times:
        out.setdefault("ttft", []).append(times[0] - start)
        out.setdefault("itl", []).extend(np.diff(times).tolist())


async def _burst(url: str, decodes, burst, delay_s: float) -> tuple[dict, dict]:
    dec: dict = {}
    bur: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def later(prompt, n):
            await asyncio.sleep(delay_s)
            await _timed_stream(session, url, prompt, n, bur)

        await asyncio.gather(
            *(_timed_stream(session, url, p, n, dec) for p, n in decodes),
            *(later(p, n) for p, n in burst),
        )
    return dec, bur


def _disagg_workload(engine: dict, vocab: int, args) -> tuple[list, list]:
    rng = np.random.default_rng(args.seed + 1)
    max_len = engine["max_model_len"]
    decode_out = min(64, max_len - 16)
    decodes = [(rng.integers(3, vocab, 8).tolist(), decode_out) for _ in range(args.num_decodes)]
    long_len = max_len - 8
    burst = [(rng.integers(3, vocab, long_len).tolist(), 4) for _ in range(args.burst + 1)]
    return decodes, burst  # the last long prompt warms the servers up


def _disagg_run(name: str, url: str, decodes, burst, warm) -> dict:
    # Warm the path: a decode, and a long prompt of its own (the connector's block copies
    # compile on first use: warm-up does not compile them yet).
    asyncio.run(_burst(f"{url}/v1/completions", decodes[:1], warm, 0.0))
    dec, bur = asyncio.run(_burst(f"{url}/v1/completions", decodes, burst, 0.5))
    return {
        "name": name,
        "decode_itl_s": _percentiles(dec.get("itl", [])),
        "decode_ttft_s": _percentiles(dec.get("ttft", [])),
        "burst_ttft_s": _percentiles(bur.get("ttft", [])),
        "errors": dec.get("errors", []) + bur.get("errors", []),
    }


def run_disagg(args, preset) -> dict:
    """Colocated (one server), then a producer and a consumer behind ``jaxserve router``."""
    model = prepare_model(preset, Path(args.cache))
    engine = _engine(preset)
    decodes, burst = _disagg_workload(engine, model.vocab_size, args)
    runs = []
    colocated = _server("colocated", model, engine, args, [])
    colocated.start()
    try:
        colocated.wait_healthy(args.startup_timeout)
        runs.append(_disagg_run("colocated", colocated.base_url, decodes, burst[:-1], burst[-1:]))
    finally:
        colocated.stop()
    for connector in args.kv_connectors:
        runs.append(_disagg_connector(connector, model, engine, args, decodes, burst))
    by = {r["name"]: r for r in runs}
    colocated_p99 = by["colocated"]["decode_itl_s"].get("p99")
    ratios = {}
    for connector in args.kv_connectors:
        p99 = by[DISAGG_RUNS[connector]]["decode_itl_s"].get("p99")
        key = "itl_p99_disagg_over_colocated" + ("" if connector == "shared_storage" else
                                                 f"_{connector}")  # fmt: skip
        ratios[key] = p99 / colocated_p99 if p99 and colocated_p99 else None
    return {
        "mode": "disagg",
        "engine": engine,
        "num_decodes": len(decodes),
        "burst": len(burst) - 1,
        "runs": runs,
        "ratios": ratios,
    }


# --disagg's connectors (--kv-connectors) and the names of their runs.
DISAGG_RUNS = {"shared_storage": "disaggregated", "jax_transfer": "disagg-transfer"}


def _disagg_connector(connector: str, model, engine: dict, args, decodes, burst) -> dict:
    """A producer and a consumer of ``connector`` behind ``jaxserve router``: one run.
    jax_transfer's consumer learns each offer from the prefill's answer, so its router passes
    kv_transfer_params."""
    store = Path(args.cache) / "fleet-kv-store"
    servers = []
    for role in ("kv_producer", "kv_consumer"):
        if connector == "jax_transfer":
            # The burst's 4 copies (16 padded blocks each) against a 48-block pool: the
            # default cap (0.5: 24 blocks) holds one at a time, so offers not yet pulled would
            # be released and recomputed; 1.0 holds three.
            kv = {"kv_connector": "JaxTransferConnector", "kv_role": role,
                  "kv_connector_extra_config": {"max_held_offers_fraction": 1.0}}  # fmt: skip
        else:
            kv = {"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        servers.append(_server(f"{role}-{connector}", model, engine, args,
                               ["--kv-transfer-config", json.dumps(kv)]))  # fmt: skip
    port = free_port()
    router_cmd = [sys.executable, "-m", "jaxserve.cli", "router", "--port", str(port),
                  "--prefill", servers[0].base_url, "--decode", servers[1].base_url,
                  "--uvicorn-log-level", "warning"]  # fmt: skip
    if connector == "jax_transfer":
        router_cmd.append("--pass-kv-transfer-params")
    router = ServerProcess("router", router_cmd, servers[0].env, port,
                           Path(args.log_dir) / f"fleet-router-{connector}.log")  # fmt: skip
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(args.startup_timeout)
        router.start()
        router.wait_healthy(60)
        run = _disagg_run(DISAGG_RUNS[connector], router.base_url, decodes, burst[:-1],
                          burst[-1:])  # fmt: skip
        text = _get(f"{servers[1].base_url}/metrics")
        run["consumer_loaded_blocks"] = _metric_sum(
            text, "jaxserve:kv_connector_loaded_blocks_total"
        )
        run["consumer_load_failures"] = _metric_sum(
            text, "jaxserve:kv_connector_load_failures_total"
        )
    finally:
        for s in (router, *servers):
            s.stop()
    return run


# ---- report ---------------------------------------------------------------------------------


def print_fleet(report: dict) -> None:
    if report["mode"] == "data_parallel":
        print(f"data parallel: {report['replicas']} replicas, {report['conversations']} "
              f"conversations x {report['turns']} turns")  # fmt: skip
        print(f"{'config':<12} {'hit rate':>9} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9}")
        for r in report["runs"]:
            t = r["ttft_s"]
            print(f"{r['name']:<12} {r['prefix_hit_rate']:>9.3f} {r['output_tok_s']:>10.1f} "
                  f"{t.get('p50', 0) * 1e3:>7.0f}ms {t.get('p99', 0) * 1e3:>7.0f}ms")  # fmt: skip
    else:
        print(f"disaggregated: {report['num_decodes']} decodes, a burst of {report['burst']}")
        print(f"{'config':<16} {'ITL p50':>8} {'ITL p99':>8} {'burst TTFT p50':>15} "
              f"{'loaded':>7} {'failed':>7}")  # fmt: skip
        for r in report["runs"]:
            i, b = r["decode_itl_s"], r["burst_ttft_s"]
            loads = [r.get(k) for k in ("consumer_loaded_blocks", "consumer_load_failures")]
            loads = [f"{v:>7.0f}" if v is not None else f"{'-':>7}" for v in loads]
            print(f"{r['name']:<16} {i.get('p50', 0) * 1e3:>6.1f}ms {i.get('p99', 0) * 1e3:>6.1f}ms"
                  f" {b.get('p50', 0) * 1e3:>13.0f}ms {' '.join(loads)}")  # fmt: skip
    for key, value in report["ratios"].items():
        print(f"{key}: {'-' if value is None else f'{value:.2f}'}")
