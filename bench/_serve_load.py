"""bench/serve.py's client: one streamed request, a run of them at a rate, and its
summary (TTFT, ITL, TPOT, E2E percentiles and throughputs)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
from _metrics import _percentiles  # noqa: E402
from _serve_presets import SERVED_NAME  # noqa: E402

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
