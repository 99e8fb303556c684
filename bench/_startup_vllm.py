"""bench/startup.py's experiment 5, vLLM's side: its CPU backend on the same 57M checkpoint,
in the same run.

With ``--vllm-python PATH`` (an interpreter with vLLM's CPU build), each vLLM measurement is a
fresh process of bench/_vllm_startup.py under it (never importing jaxserve), timed from just
before the spawn to vLLM imported, to ``LLM(...)`` built and to the first request's first
token. Its compilation cache is vLLM's own (VLLM_CACHE_ROOT and torch inductor's folder), in
one fresh folder for the experiment: empty for the first process, filled by the earlier ones
for the second processes. The settings
follow jaxserve's engine as far as vLLM allows (``settings``): float32, the same block size,
max_num_seqs, token budget, max_model_len, prefix caching, seed, and a KV pool of the same
bytes (jaxserve's usable blocks x block bytes, passed as kv_cache_memory_bytes); no tokenizer
(the checkpoint has none).

Without an interpreter nothing of vLLM runs here: ``fallback`` labels the comparison as the
issue's figure, not the same run's; an interpreter that cannot import vLLM is refused.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from _baselines import vllm_available, vllm_env
from _metrics import ModelShape

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "_vllm_startup.py"
# vLLM 0.32's CPU backend, LLM(...) on the 57M checkpoint (issue 35, this machine).
VLLM_CPU_ISSUE_S = 52.1
# vLLM's log lines about its compilation cache (INFO level), counted per process: the AOT
# path (the default with torch >= 2.10) and the per-graph cache (VLLM_USE_AOT_COMPILE=0; the
# 0.32 CPU build logged none of these in our runs: cache_after's file count tells instead).
CACHE_EVENTS = {
    "aot_loaded": "Directly load AOT compilation",
    "aot_load_failed": "Compiling model again due to a load failure",
    "aot_saved": "saved AOT compiled function",
    "graph_loaded": "Directly load the compiled graph(s)",
    "graph_compiled": "Compiling a graph for compile range",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def settings(engine: dict) -> dict:
    """vLLM's LLM arguments for jaxserve's ``engine`` (LLM arguments, ``model`` a checkpoint
    folder with config.json)."""
    cfg = json.loads((Path(engine["model"]) / "config.json").read_text())
    dtype = engine.get("dtype", "float32")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: vLLM's comparison supports {sorted(DTYPE_BYTES)}")
    shape = replace(ModelShape.from_hf_config(cfg), bytes_per_param=DTYPE_BYTES[dtype])
    usable = engine["num_kv_blocks"] - 1  # jaxserve's null block holds no tokens
    return dict(
        model=engine["model"],
        skip_tokenizer_init=True,
        dtype=dtype,
        block_size=engine["block_size"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_model_len=engine["max_model_len"],
        kv_cache_memory_bytes=usable * engine["block_size"] * shape.kv_bytes_per_token,
        enable_prefix_caching=engine.get("enable_prefix_caching", True),
        seed=engine.get("seed", 0),
    )


def command(python: str, spec: dict, spawn: float) -> list[str]:
    """The vLLM process: the driver under ``python``, the spec and the spawn time."""
    return [python, str(DRIVER), json.dumps(spec), repr(spawn)]


def child_env(folder: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment (bench/_baselines.py's: XLA_FLAGS removed, the torchvision shim),
    its compilation caches in ``folder``, INFO logging for the cache's log lines, then
    ``extra`` (--vllm-env: vLLM's own switches; the cache folders cannot be overridden)."""
    extra = dict(extra or {})
    fixed = {"VLLM_LOGGING_LEVEL", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"}
    if fixed & set(extra):
        raise ValueError(f"--vllm-env {sorted(fixed & set(extra))}: set by the benchmark")
    env = vllm_env(folder / "shim", "INFO")
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    env["VLLM_CACHE_ROOT"] = str(folder / "vllm")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    env.update(extra)
    return env


def parse_env(items: list[str] | None) -> dict[str, str]:
    """--vllm-env KEY=VALUE items as a dict; a bad item raises ValueError naming it."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum():
            raise ValueError(f"--vllm-env {item!r}: expected KEY=VALUE (KEY: letters, digits, _)")
        out[key] = value
    return out


def parse(stdout: str) -> dict:
    """The driver's RESULT line and vLLM's log, as the report's row: seconds from the spawn
    stamps, the cache's log lines counted, vLLM's own engine init time."""
    lines = stdout.splitlines()
    line = next((x for x in reversed(lines) if x.startswith("RESULT ")), None)
    if line is None:
        raise ValueError("no RESULT line in the vLLM process's output")
    r = json.loads(line[len("RESULT ") :])
    init = [float(m[1]) for x in lines if (m := ENGINE_INIT.search(x))]
    return {
        "import_s": r["imported"] - r["spawn"],
        "construct_s": r["built"] - r["imported"],
        "first_token_s": r["first_token"] - r["built"],
        "to_first_token_s": r["first_token"] - r["imported"],
        "spawn_to_construct_s": r["built"] - r["spawn"],
        "spawn_to_first_token_s": r["first_token"] - r["spawn"],
        "engine_init_s": init[-1] if init else None,
        "cache_events": {k: sum(text in x for x in lines) for k, text in CACHE_EVENTS.items()},
        "cache_messages": [
            x.strip()[-300:] for x in lines if any(t in x for t in CACHE_EVENTS.values())
        ],
        "token_ids": r["token_ids"],
        "vllm_version": r["vllm_version"],
        "torch_version": r["torch_version"],
    }


def run(
    python: str, spec: dict, folder: Path, extra_env: dict | None = None, timeout: float = 1800
) -> dict:
    """One fresh vLLM process on the cache folder ``folder``; its parsed row and wall_s."""
    spawn = time.time()
    proc = subprocess.run(
        command(python, spec, spawn), capture_output=True, text=True,
        env=child_env(folder, extra_env), timeout=timeout,
    )  # fmt: skip
    wall = time.time() - spawn
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
        raise RuntimeError(f"vLLM process failed (rc {proc.returncode}):\n{tail}")
    out = parse(proc.stdout + "\n" + proc.stderr)
    out["wall_s"] = wall
    files = [p for p in folder.rglob("*") if p.is_file() and "shim" not in p.parts]
    out["cache_after"] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return out


def fallback() -> dict:
    """The report's vLLM entry when no vLLM runs (no --vllm-python): the issue's figure,
    labelled as not this run's."""
    return {
        "same_run": False,
        "python": None,
        "note": "NOT the same run (no --vllm-python given): compared with the issue's figure, "
        f"vLLM 0.32 CPU, LLM(...) on the 57M checkpoint: {VLLM_CPU_ISSUE_S} s",
        "issue_llm_construct_s": VLLM_CPU_ISSUE_S,
    }


def start(python: str | None, extra_env: dict | None = None) -> dict:
    """The report's vLLM entry, before any run: same-run with ``python``, whose vLLM version
    is probed now (an interpreter without vLLM is refused: ValueError); else the fallback."""
    if not python:
        if extra_env:
            raise ValueError(f"--vllm-env {sorted(extra_env)} without --vllm-python")
        return fallback()
    version = vllm_available(python)
    if version is None:
        raise ValueError(f"--vllm-python {python!r}: `import vllm` fails with this interpreter")
    env = dict(extra_env or {})
    return {"same_run": True, "python": python, "version": version, "env": env, "runs": []}


def summarize(entry: dict) -> None:
    """A same-run entry's means over its second processes, second over first (spawn -> first
    token), and its note."""
    runs = entry["runs"]
    seconds = runs[1:]
    spawn = sum(r["spawn_to_first_token_s"] for r in seconds) / len(seconds)
    llm = sum(r["to_first_token_s"] for r in seconds) / len(seconds)
    entry["second_spawn_to_first_token_s"] = spawn
    entry["second_to_first_token_s"] = llm
    entry["second_over_first"] = spawn / runs[0]["spawn_to_first_token_s"]
    env = " ".join(f"{k}={v}" for k, v in entry.get("env", {}).items())
    entry["note"] = (
        f"vLLM {entry['version']} CPU measured in this run ({entry['python']}"
        + (f", {env}" if env else "")
        + "): second process "
        f"(mean of {len(seconds)}) spawn -> first token {spawn:.1f} s, LLM(...) -> first token "
        f"{llm:.1f} s"
    )


def goals(big: dict, vllm: dict, goal) -> dict:
    """The 57M goals against vLLM: the same run's second processes when vLLM ran, else the
    issue's figure (labelled). ``big``: jaxserve's 57M phases entry; ``goal``: startup._goal."""
    if not vllm.get("same_run"):
        return {
            "57m_second_vs_vllm": goal(
                "57M model, second process, spawn to first token <= 0.35x vLLM-CPU's LLM(...) "
                "(the issue's figure, not this run's)",
                big["second_spawn_to_first_token_s"] / VLLM_CPU_ISSUE_S, 0.35, "<=",
                note=vllm["note"],
            )
        }  # fmt: skip
    return {
        "57m_second_vs_vllm": goal(
            "57M model, second process, LLM(...) to first token <= 0.35x vLLM-CPU's (same run)",
            big["second_to_first_token_s"] / vllm["second_to_first_token_s"], 0.35, "<=",
            note=vllm["note"],
        ),
        "57m_second_vs_vllm_spawn": goal(
            "57M model, second process, spawn to first token (imports included) <= 0.35x "
            "vLLM-CPU's (same run)",
            big["second_spawn_to_first_token_s"] / vllm["second_spawn_to_first_token_s"],
            0.35, "<=",
        ),
    }  # fmt: skip


def print_vllm(entry: dict, big: dict | None) -> None:
    """Experiment 5's vLLM rows, beside jaxserve's 57M rows when both ran."""
    if not entry.get("same_run"):
        print(f"  {entry['note']}")
        return
    print(f"  vLLM {entry['version']} CPU, same checkpoint, same run (seconds):")
    cols = ("import", "LLM(...)", "1st tok", "LLM->tok", "spawn->tok")
    print(f"  {'engine / process':<22}" + "".join(f"{c:>11}" for c in cols)
          + "  cache: AOT load/fail/save, graph load/compile")  # fmt: skip
    for i, v in enumerate(entry["runs"]):
        label = "first" if i == 0 else "second" if len(entry["runs"]) == 2 else f"second {i}"
        if big is not None and i < len(big["runs"]):
            run = big["runs"][i]
            cells = (run["import_s"], run["first"]["construct_s"], run["first"]["first_token_s"],
                     run["first"]["to_first_token_s"], run["spawn_to_first_token_s"])  # fmt: skip
            print(f"  {'jaxserve 57m ' + label:<22}" + "".join(f"{c:>11.2f}" for c in cells))
        cells = (v["import_s"], v["construct_s"], v["first_token_s"], v["to_first_token_s"],
                 v["spawn_to_first_token_s"])  # fmt: skip
        ev = [str(v["cache_events"].get(k, 0)) for k in CACHE_EVENTS]
        events = "/".join(ev[:3]) + ", " + "/".join(ev[3:])
        print(f"  {'vLLM 57m ' + label:<22}" + "".join(f"{c:>11.2f}" for c in cells)
              + f"  {events}")  # fmt: skip
    print(f"  {entry['note']}")
