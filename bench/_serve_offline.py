"""bench/serve.py's offline reference: jaxserve's LLM.generate in a worker subprocess,
and the CPU seconds of process groups."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
from _machine import loadavg  # noqa: E402
from _serve_servers import Model  # noqa: E402

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
            [sys.executable, str(HERE / "serve.py"), "--offline-worker", str(spec_path)],
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
