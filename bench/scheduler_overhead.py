"""Host overhead of the scheduler: microseconds per engine step (schedule + update_from_output).

A fake model samples instantly, so what is timed is only the host-side bookkeeping that every
real step pays on top of the device forward. Workloads:

    decode-64 / decode-256 / decode-1024   N requests all in steady decode (1 token each)
    mixed-256                              open-loop arrivals (4 per step) of prompts of 32..384
                                           tokens, half behind a shared 256-token prefix, 16..112
                                           output tokens: ~256 running, chunked prefills
                                           interleaved with decodes, prefix hits, finishes

Each workload is replayed ``--runs`` times on a fresh scheduler; a run's figure is the mean over
its measured steps; the table shows the median and p10 over runs (p10: the 10th percentile,
i.e. a fast run). Building the fake
ModelRunnerOutput is not timed, adding requests is not timed.

With ``--vllm PYTHON`` the same workloads (same requests, budgets and pool) also drive vLLM V1's
own Scheduler under that interpreter (bench/scheduler_overhead_vllm.py, fed fake
ModelRunnerOutputs as vLLM's unit tests do), side by side in one run.

    python bench/scheduler_overhead.py [--runs 7] [--vllm /tmp/vllm-venv/bin/python]

Times are wall clock (perf_counter); the cpu column is thread CPU time, the steadier figure
on a loaded machine. Writes bench/results/scheduler_overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "scheduler_overhead.json"
VOCAB = 32000


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def decode_workload(num_reqs: int, steps: int) -> dict:
    """num_reqs requests arriving together, never finishing within the measured steps."""
    rng = random.Random(num_reqs)
    requests = [
        {"arrival": 0, "prompt": _prompt(rng, 32), "max_tokens": 100_000} for _ in range(num_reqs)
    ]
    # Prefill of num_reqs x 32 tokens takes num_reqs * 32 / 8192 steps; then all decode.
    warmup = num_reqs * 32 // 8192 + 8
    return _spec(f"decode-{num_reqs}", requests, max(num_reqs, 256), warmup, steps)


def mixed_workload(steps: int) -> dict:
    rng = random.Random(0)
    shared_prefix = _prompt(rng, 256)
    warmup = 150
    requests = []
    for step in range(warmup + steps):
        for _ in range(4):
            length = rng.randint(32, 384)
            if rng.random() < 0.5:
                prompt = shared_prefix + _prompt(rng, max(length - 256, 16))
            else:
                prompt = _prompt(rng, length)
            requests.append({"arrival": step, "prompt": prompt, "max_tokens": rng.randint(16, 112)})
    return _spec("mixed-256", requests, 512, warmup, steps)


def _spec(name: str, requests: list[dict], max_num_seqs: int, warmup: int, steps: int) -> dict:
    return {
        "name": name,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 8192 if name.startswith("decode") else 2048,
        "block_size": 16,
        "num_blocks": 65536,
        "max_model_len": 4096,
        "warmup_steps": warmup,
        "steps": steps,
        "requests": requests,
    }


def _fake_runner_output(sched: Scheduler, so, step: int) -> ModelRunnerOutput:
    """Sample one token for each request whose scheduled tokens reach its last token."""
    requests = sched.requests
    req_ids, sampled = [], []
    for rid, num in so.num_scheduled_tokens.items():
        req = requests[rid]
        if req.num_computed_tokens + num >= len(req.all_token_ids):
            req_ids.append(rid)
            sampled.append([(step * 31 + len(req_ids)) % (VOCAB - 1) + 1])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_jaxserve(spec: dict) -> dict:
    """One replay of a workload on a fresh scheduler; host time per measured step."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=spec["max_model_len"],
        ),
        CacheConfig(block_size=spec["block_size"], enable_prefix_caching=True),
        spec["num_blocks"],
    )
    # As an engine does after start-up (vLLM's EngineCore too): the long-lived pool leaves the
    # garbage collector's view, so collections only walk per-step garbage.
    gc.collect()
    gc.freeze()
    arrivals: dict[int, list[tuple[int, dict]]] = {}
    for i, r in enumerate(spec["requests"]):
        arrivals.setdefault(r["arrival"], []).append((i, r))
    warmup, steps = spec["warmup_steps"], spec["steps"]
    wall = cpu = 0.0
    scheduled = 0
    for step in range(warmup + steps):
        for i, r in arrivals.get(step, ()):
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
            sched.add_request(Request(str(i), r["prompt"], params, arrival_time=float(step)))
        t0, c0 = time.perf_counter(), time.thread_time()
        so = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        mro = _fake_runner_output(sched, so, step)
        t2, c2 = time.perf_counter(), time.thread_time()
        sched.update_from_output(so, mro)
        t3, c3 = time.perf_counter(), time.thread_time()
        if step >= warmup:
            wall += (t1 - t0) + (t3 - t2)
            cpu += (c1 - c0) + (c3 - c2)
            scheduled += len(so.num_scheduled_tokens)
    gc.unfreeze()
    return {
        "wall_us": wall / steps * 1e6,
        "cpu_us": cpu / steps * 1e6,
        "mean_scheduled_reqs": scheduled / steps,
    }


def _summarise(runs: list[dict]) -> dict:
    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[round(q * (len(values) - 1))]

    wall = [r["wall_us"] for r in runs]
    cpu = [r["cpu_us"] for r in runs]
    return {
        "median_us": statistics.median(wall),
        "p10_us": pct(wall, 0.1),
        "cpu_median_us": statistics.median(cpu),
        "cpu_p10_us": pct(cpu, 0.1),
        "runs": runs,
        "mean_scheduled_reqs": runs[-1]["mean_scheduled_reqs"],
    }


class VllmCompanion:
    """bench/scheduler_overhead_vllm.py under another interpreter, kept alive so that its runs
    interleave with ours (the same background load hits both)."""

    def __init__(self, python: str, specs: list[dict], tmp: Path) -> None:
        spec_path = tmp / "specs.json"
        spec_path.write_text(json.dumps(specs))
        self.log = (tmp / "vllm.log").open("w+")
        self.proc = subprocess.Popen(
            [python, str(ROOT / "scheduler_overhead_vllm.py"), str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        header = json.loads(self._read())
        self.version = header["version"]

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError("vLLM companion died:\n" + self.log.read()[-3000:])
        return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vllm", metavar="PYTHON", help="interpreter with vLLM installed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    specs = [decode_workload(n, args.steps) for n in (64, 256, 1024)]
    specs.append(mixed_workload(args.steps))
    ours: dict[str, list[dict]] = {s["name"]: [] for s in specs}
    theirs: dict[str, list[dict]] = {s["name"]: [] for s in specs}
    with tempfile.TemporaryDirectory() as tmp:
        companion = VllmCompanion(args.vllm, specs, Path(tmp)) if args.vllm else None
        for _ in range(args.runs):  # interleaved: run i of every workload on both engines
            for spec in specs:
                ours[spec["name"]].append(run_jaxserve(spec))
                if companion is not None:
                    theirs[spec["name"]].append(companion.run(spec["name"]))
        if companion is not None:
            companion.close()
    ours_sum = {name: _summarise(runs) for name, runs in ours.items()}
    theirs_sum = {name: _summarise(runs) for name, runs in theirs.items() if runs}
    _print_table(ours_sum, theirs_sum)
    result = {
        "command": " ".join(["python", "bench/scheduler_overhead.py", *sys.argv[1:]]),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "method": "host us per step = schedule() + update_from_output(), fake runner output "
        f"not timed; per run the mean over {args.steps} measured steps; median and p10 over "
        f"{args.runs} interleaved runs; wall = perf_counter, cpu = thread_time",
        "vllm_version": companion.version if companion is not None else None,
        "jaxserve": ours_sum,
        "vllm": theirs_sum,
        "speedup_vs_vllm": {
            k: {
                "wall": theirs_sum[k]["median_us"] / ours_sum[k]["median_us"],
                "cpu": theirs_sum[k]["cpu_median_us"] / ours_sum[k]["cpu_median_us"],
            }
            for k in theirs_sum
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _print_table(ours: dict, theirs: dict) -> None:
    cols = f"{'workload':<12} {'reqs/step':>9} | {'jaxserve median':>15} {'p10':>7} {'cpu':>7}"
    if theirs:
        cols += f" | {'vLLM median':>11} {'p10':>7} {'cpu':>7} | {'speedup':>7}"
    print(cols)
    print("-" * len(cols))
    for name, row in ours.items():
        line = (
            f"{name:<12} {row['mean_scheduled_reqs']:>9.0f} | {row['median_us']:>12.0f} us"
            f" {row['p10_us']:>7.0f} {row['cpu_median_us']:>7.0f}"
        )
        if name in theirs:
            v = theirs[name]
            line += (
                f" | {v['median_us']:>8.0f} us {v['p10_us']:>7.0f} {v['cpu_median_us']:>7.0f}"
                f" | {v['median_us'] / row['median_us']:>6.1f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
