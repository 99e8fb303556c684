"""Offline throughput, side by side, in the spirit of `vllm bench throughput`.

jaxserve (continuous batching, prefix caching on) against, on the same checkpoint and the same
token-id prompts, in one run:

    static     the same model and jitted step, fed the pre-vLLM way (bench/_jaxserve_runs.py)
    nocache    jaxserve with prefix caching off (datasets with shared prefixes only)
    hf         Hugging Face transformers `generate`, PyTorch CPU float32, batches of 16
    vllm       vLLM itself (its CPU build, run by bench/vllm_throughput.py in its own venv)
    vllm-nocache  vLLM with prefix caching off (datasets with shared prefixes only): its own
               on / off ratio beside jaxserve's

On the prefix dataset the report also gives the work ratio: the model FLOPs of the run with
caching off over those with it on (prefill skipped for cached tokens, decode unchanged), the
on / off speedup that cache would give if every token cost the same.

Datasets (bench/_datasets.py): sharegpt (lognormal lengths), random (fixed lengths with a range
ratio), prefix (shared 256-token prefixes). Requests run with ignore_eos and temperature 1.0 (as
`vllm bench throughput` does), so every engine generates exactly the same number of tokens.

Reported per engine: requests/s, output and total tokens/s, TTFT / TPOT / end-to-end
percentiles (from the step at which each token reached the caller), and for jaxserve the peak
KV slot utilization, prefix hit rate (vs the dataset's ideal), preemptions, compilations in
warm-up and during the timed runs, and model FLOP/s and bytes/s against the machine's matmul
and streaming copy measured in the same run. jaxserve's continuous run is done first and again
last ("bracketing"): ratios use the mean of the two, which cancels a linear drift of the
machine's load; the spread of the two is reported.

    python bench/throughput.py                      # full run: 50M-param model, all baselines
    python bench/throughput.py --preset quick       # tiny model, < 3 min (~1 min of it vLLM)
    python bench/throughput.py --baselines static,hf --datasets sharegpt --num-requests 32
    python bench/throughput.py --request-rate 4     # Poisson arrivals (jaxserve only)

Writes bench/results/throughput.json (quick: throughput_quick.json); plot with bench/plot.py.
The benchmark checkpoint is random-weight, Llama-shaped, written by transformers itself into
bench/.cache/ on first use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _baselines  # noqa: E402
import _datasets  # noqa: E402
import _jaxserve_runs  # noqa: E402
from _machine import git_state, loadavg, machine  # noqa: E402
from _metrics import ModelShape, RunResult, machine_limits, utilization  # noqa: E402

from jaxserve.runner.xla_flags import apply_cpu_workarounds  # noqa: E402

CACHE = HERE / ".cache"
RESULTS = HERE / "results"
ALL_BASELINES = ("static", "nocache", "hf", "vllm", "vllm-nocache")
DEFAULT_VLLM_PYTHON = "/tmp/vllm-venv/bin/python"


@dataclass(frozen=True)
class Preset:
    """A model, engine limits and dataset shapes that belong together."""

    model_name: str
    model: dict  # write_tiny_hf_checkpoint overrides
    engine: dict  # EngineSettings fields (model excluded)
    datasets: tuple[str, ...]
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)  # dataset name -> builder options
    baselines: tuple[str, ...] = ALL_BASELINES
    output: str = "throughput.json"
    limits: dict = field(default_factory=dict)  # machine_limits sizes


PRESETS = {
    # ~57M parameters (24M in the layers, 2 x 16M embedding + lm_head), fp32.
    "default": Preset(
        model_name="llama-57m",
        model=dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=32,
            num_kv_blocks=4096,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=64,
    ),
    "quick": Preset(
        model_name="llama-tiny-1m",
        model=dict(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=32,
            num_kv_blocks=256,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            max_model_len=256,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=16,
        dataset_kw={
            "sharegpt": dict(mean_input=40, mean_output=60, max_prompt_len=128, max_total_len=256),
            "prefix": dict(num_prefixes=2, prefix_len=64, suffix_len=64, output_len=32),
        },
        baselines=("static", "nocache", "hf", "vllm"),  # a second vLLM start-up: over 3 min
        output="throughput_quick.json",
    ),
    # For tests/bench: seconds, not minutes (4 compilations: T in {16}, B in {1, 2}).
    "smoke": Preset(
        model_name="llama-smoke",
        model=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            initializer_range=0.02,
        ),
        engine=dict(
            block_size=16,
            num_kv_blocks=16,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=32,
        ),
        datasets=("sharegpt", "prefix"),
        num_requests=4,
        dataset_kw={
            "sharegpt": dict(mean_input=8, mean_output=6, max_prompt_len=16, max_total_len=32),
            "prefix": dict(num_prefixes=2, prefix_len=16, suffix_len=4, output_len=4),
        },
        baselines=("static", "nocache", "hf"),
        output="throughput_smoke.json",
        limits=dict(matmul_n=256, copy_mib=16),
    ),
}


def ensure_checkpoint(preset: Preset, cache: Path = CACHE) -> Path:
    """The preset's random checkpoint, written once into `cache` (rewritten if its config
    changed)."""
    folder = cache / preset.model_name
    marker = folder / "bench_overrides.json"
    wanted = json.dumps(preset.model, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted and (folder / "config.json").exists():
        return folder
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(folder, "llama", with_tokenizer=False, **preset.model)
    marker.write_text(wanted)
    return folder


# ---- running ------------------------------------------------------------------------------


class Bench:
    """One benchmark invocation: the engine, the datasets, and the results gathered."""

    def __init__(self, args: argparse.Namespace, preset: Preset) -> None:
        self.args = args
        self.preset = preset
        self.model_dir = ensure_checkpoint(preset, Path(args.cache))
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.shape = ModelShape.from_hf_config(cfg)
        self.settings = _jaxserve_runs.EngineSettings(
            model=str(self.model_dir), seed=args.seed, **preset.engine
        )
        n = args.num_requests or preset.num_requests
        self.datasets = {
            name: _datasets.build(
                name,
                n,
                self.shape.vocab,
                self.settings.block_size,
                seed=args.seed,
                **preset.dataset_kw.get(name, {}),
            )
            for name in args.datasets
        }
        self.runs: dict[str, dict[str, list[RunResult]]] = {d: {} for d in self.datasets}
        self.load: dict[str, list[float]] = {"start": loadavg()}
        self.info: dict = {}
        self.wall_s: float | None = None

    def _add(self, dataset: str, result: RunResult) -> None:
        result.extra["loadavg_after"] = loadavg()
        self.runs[dataset].setdefault(result.engine, []).append(result)
        s = result.summary()
        print(
            f"  {dataset:9s} {result.engine:16s} {s['elapsed_s']:7.1f} s  "
            f"{s['output_tokens_per_s']:8.1f} out tok/s  load {loadavg()[0]}",
            flush=True,
        )

    def run_all(self) -> None:
        """Machine limits, jaxserve's warm-up, then the stages in an order that keeps the
        headline comparison (jaxserve vs vLLM) close in time: jaxserve, vLLM, the jaxserve
        baselines, transformers, jaxserve again. A failing baseline is recorded, not fatal;
        the results file is rewritten after every stage."""
        print(f"machine limits ... (load {loadavg()})", flush=True)
        self.info["machine_limits"] = machine_limits(**self.preset.limits)
        engine = self._warm_up_jaxserve()
        for label, stage in self._stages(engine):
            try:
                stage()
            except Exception as exc:  # a baseline's failure must not lose the other results
                if label.startswith("jaxserve"):
                    raise
                print(f"{label}: FAILED: {exc!r}", flush=True)
                self.info.setdefault("failed", {})[label] = repr(exc)[-2000:]
            self.save(partial=True)
        self.load["end"] = loadavg()

    def _warm_up_jaxserve(self):
        """Build and warm up jaxserve's engine (recording its warm-up in info["jaxserve"])."""
        print(f"jaxserve: building and warming up {self.model_dir.name} ...", flush=True)
        engine, warm_s, warm_compiles = _jaxserve_runs.build_engine(self.settings)
        first = next(iter(self.datasets.values())).requests
        self.info["jaxserve"] = {
            "warmup_s": warm_s,
            "warmup_compilations": warm_compiles,
            "warmup_run_compilations": _jaxserve_runs.warm_up_run(engine, first),
            "buckets": {
                "tokens": list(engine.runner.buckets.token_buckets),
                "rows_max": engine.runner.buckets.max_rows,
                "widths": list(engine.runner.buckets.width_buckets),
            },
        }
        return engine

    def _stages(self, engine) -> list[tuple[str, Callable[[], None]]]:
        """(label, run) of every stage the arguments ask for, in run_all's order."""
        a = self.args
        mode = "poisson" if a.request_rate != float("inf") else "offline"
        common = dict(temperature=a.temperature, request_rate=a.request_rate, seed=a.seed)

        def jaxserve_pass(name: str, **kw) -> Callable[[], None]:
            return lambda: self._jaxserve_pass(engine, name, **kw)

        stages = [("jaxserve", jaxserve_pass("jaxserve", mode=mode, **common))]
        if "vllm" in a.baselines:
            stages.append(("vllm", self._run_vllm))
        if "vllm-nocache" in a.baselines and any(
            d.ideal_prefix_hit_tokens for d in self.datasets.values()
        ):
            stages.append(("vllm-nocache", lambda: self._run_vllm(enable_prefix_caching=False)))
        if "static" in a.baselines:
            static = dict(mode="static", static_batch_size=a.static_batch_size, **common)
            stages.append(("static", jaxserve_pass("static", **static)))
        if "nocache" in a.baselines:
            nocache = dict(mode=mode, enable_prefix_caching=False, **common)
            stages.append(("nocache", jaxserve_pass("jaxserve-nocache", **nocache)))
        for on in a.async_scheduling:  # the same engine with async scheduling switched
            name = f"jaxserve-async-{'on' if on else 'off'}"
            stages.append((name, jaxserve_pass(name, mode=mode, async_scheduling=on, **common)))
        if "hf" in a.baselines:
            stages.append(("hf", self._hf_pass))
        if a.bracket:  # the plan's async scheduling again
            default = engine.core.config.scheduler.async_scheduling
            again = jaxserve_pass("jaxserve", mode=mode, async_scheduling=default, **common)
            stages.append(("jaxserve-again", again))
        return stages

    def _jaxserve_pass(self, engine, name: str, **kw) -> None:
        """jaxserve on every dataset (with prefix caching off: only those whose prefixes
        repeat), each run recorded under `name`."""
        for ds_name, ds in self.datasets.items():
            if kw.get("enable_prefix_caching") is False and not ds.ideal_prefix_hit_tokens:
                continue  # caching off only matters where prefixes repeat
            self._add(ds_name, _jaxserve_runs.run(engine, ds.requests, name=name, **kw))

    def _hf_pass(self) -> None:
        """transformers on every dataset."""
        a = self.args
        for ds_name, ds in self.datasets.items():
            self._add(
                ds_name,
                _baselines.run_hf(
                    str(self.model_dir),
                    ds.requests,
                    batch_size=a.hf_batch_size,
                    temperature=a.temperature,
                    seed=a.seed,
                ),
            )

    def save(self, partial: bool = False) -> dict:
        report = self.report()
        report["partial"] = partial
        self.args.output.parent.mkdir(parents=True, exist_ok=True)
        self.args.output.write_text(json.dumps(report, indent=1))
        return report

    def _run_vllm(self, enable_prefix_caching: bool = True) -> None:
        label = "vllm" if enable_prefix_caching else "vllm-nocache"
        version = _baselines.vllm_available(self.args.vllm_python)
        if version is None:
            print(
                f"{label}: vllm not importable with {self.args.vllm_python}; skipped "
                "(a venv with vLLM's CPU build installed)",
                flush=True,
            )
            self.info[label] = {"skipped": f"no vllm at {self.args.vllm_python}"}
            return
        print(f"vllm {version}: starting ...", flush=True)
        engine = {k: v for k, v in self.preset.engine.items()}
        engine["bytes_per_block"] = self.shape.kv_bytes_per_token * self.settings.block_size
        # Caching off only matters where prefixes repeat.
        datasets = {
            n: d.requests
            for n, d in self.datasets.items()
            if enable_prefix_caching or d.ideal_prefix_hit_tokens
        }
        runs, info = _baselines.run_vllm(
            self.args.vllm_python,
            str(self.model_dir),
            datasets,
            engine,
            temperature=self.args.temperature,
            seed=self.args.seed,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.info[label] = info
        for name, result in runs.items():
            self._add(name, result)

    # ---- reporting ------------------------------------------------------------------------

    def report(self) -> dict:
        limits = self.info["machine_limits"]
        datasets = {}
        for name, ds in self.datasets.items():
            engines = {}
            for engine, results in self.runs[name].items():
                summaries = [r.summary() for r in results]
                s = _mean_summary(summaries)
                if engine.startswith("jaxserve"):
                    r = results[0]
                    s.update(
                        utilization(
                            self.shape,
                            r.timings,
                            r.elapsed_s,
                            r.extra.get("num_steps"),
                            limits,
                            r.extra.get("prefix_cache_hits", 0),
                        )
                    )
                    s["ideal_prefix_hit_rate"] = ds.ideal_prefix_hit_rate
                engines[engine] = s
            datasets[name] = {
                "dataset": ds.summary(),
                "engines": engines,
                "ratios": _ratios(engines),
                "cache_on_off": _cache_on_off(engines),
                "timings": {e: [r.timings_json() for r in rs] for e, rs in self.runs[name].items()},
            }
        report = {
            "preset": self.args.preset,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(self.load),
            "git": git_state(),
            "versions": _versions(),
            "model": {
                "name": self.preset.model_name,
                "path": str(self.model_dir),
                "num_params": self.shape.num_params,
                "shape": asdict(self.shape),
                "dtype": "float32",
            },
            "engine_settings": asdict(self.settings),
            "sampling": {"temperature": self.args.temperature, "ignore_eos": True},
            "request_rate": self.args.request_rate
            if self.args.request_rate != float("inf")
            else "inf",
            "compile_cache": self.args.compile_cache,
            "static_batch_size": self.args.static_batch_size,
            "hf_batch_size": self.args.hf_batch_size,
            "info": self.info,
            "wall_s": self.wall_s,
            "datasets": datasets,
        }
        report["goals"] = goals(report)
        return report


def _mean_summary(summaries: list[dict]) -> dict:
    """Numeric fields averaged over repeated runs (bracketing); the runs' output tokens/s kept."""
    if len(summaries) == 1:
        return dict(summaries[0], num_runs=1)
    out = dict(summaries[-1])
    for k in summaries[0]:
        vals = [s.get(k) for s in summaries]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = sum(vals) / len(vals)
    out["num_runs"] = len(summaries)
    out["runs_output_tokens_per_s"] = [s["output_tokens_per_s"] for s in summaries]
    return out


def _ratios(engines: dict) -> dict:
    """jaxserve's output tokens/s over each other engine's (x > 1: jaxserve faster)."""
    if "jaxserve" not in engines:
        return {}
    ours = engines["jaxserve"]["output_tokens_per_s"]
    return {
        f"jaxserve/{e}": ours / s["output_tokens_per_s"]
        for e, s in engines.items()
        if e != "jaxserve"
    }


def _cache_on_off(engines: dict) -> dict:
    """Prefix caching on / off: output tokens/s of each engine with it on over with it off, and
    jaxserve's work ratio (model FLOPs off / on: the speedup if every token cost the same)."""
    out = {}
    for on, off in (("jaxserve", "jaxserve-nocache"), ("vllm", "vllm-nocache")):
        if on in engines and off in engines:
            out[on] = engines[on]["output_tokens_per_s"] / engines[off]["output_tokens_per_s"]
    js, nc = engines.get("jaxserve", {}), engines.get("jaxserve-nocache", {})
    if js.get("model_flops") and nc.get("model_flops"):
        out["work_ratio"] = nc["model_flops"] / js["model_flops"]
    return out


def _versions() -> dict:
    import jax

    out = {"jax": jax.__version__}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def goals(report: dict) -> list[dict]:
    """The issue's goals, each with its measured value and whether it holds."""
    out = []

    def goal(text: str, value, target: float, higher: bool = True) -> None:
        if value is None:
            return
        holds = value >= target if higher else value <= target
        out.append({"goal": text, "target": target, "measured": value, "holds": bool(holds)})

    sg = report["datasets"].get("sharegpt")
    if sg:
        r, e = sg["ratios"], sg["engines"]
        goal("sharegpt: jaxserve / vllm output tok/s >= 1.5", r.get("jaxserve/vllm"), 1.5)
        goal("sharegpt: continuous / static batching >= 2.5", r.get("jaxserve/static"), 2.5)
        goal(
            "sharegpt: jaxserve / transformers generate >= 6",
            r.get("jaxserve/hf-transformers"),
            6.0,
        )
        js = e.get("jaxserve", {})
        goal("sharegpt: peak KV slot utilization >= 0.97", js.get("peak_kv_slot_utilization"), 0.97)
        goal(
            "sharegpt: model FLOP/s / matmul FLOP/s >= 0.5 (whole run)",
            js.get("mfu_vs_matmul"),
            0.5,
        )
    px = report["datasets"].get("prefix")
    if px:
        on_off = px.get("cache_on_off", {})
        goal("prefix: caching on / off >= 1.6", on_off.get("jaxserve"), 1.6)
        js = px["engines"].get("jaxserve", {})
        if "prefix_hit_rate" in js:
            gap = js["ideal_prefix_hit_rate"] - js["prefix_hit_rate"]
            goal(
                "prefix: hit rate within 0.02 of ideal (ideal - measured)", gap, 0.02, higher=False
            )
    compiles = sum(
        s.get("compilations_during_run", 0)
        for d in report["datasets"].values()
        for s in d["engines"].values()
    )
    goal("compilations after warm-up == 0", compiles, 0, higher=False)
    return out


def print_table(report: dict) -> None:
    print(
        f"\nmodel {report['model']['name']} ({report['model']['num_params'] / 1e6:.1f}M params, "
        f"fp32), load avg start {report['machine']['loadavg']['start']} end "
        f"{report['machine']['loadavg'].get('end')}"
    )
    lim = report["info"]["machine_limits"]
    print(
        f"machine: matmul {lim['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"streaming copy {lim['copy_bytes_per_s'] / 1e9:.1f} GB/s (jnp "
        f"{lim['copy_jnp_bytes_per_s'] / 1e9:.1f}, numpy {lim['copy_numpy_bytes_per_s'] / 1e9:.1f})"
    )
    head = (
        f"{'dataset':9s} {'engine':17s} {'req/s':>6s} {'out tok/s':>9s} {'tot tok/s':>9s} "
        f"{'ttft p50':>8s} {'ttft p99':>8s} {'tpot p50':>8s} {'tpot p99':>8s} "
        f"{'x ours':>6s} {'kv peak':>7s} {'hit':>6s} {'ideal':>6s} {'MFU':>5s} {'comp':>4s}"
    )
    print(head)
    print("-" * len(head))
    for name, d in report["datasets"].items():
        for engine, s in d["engines"].items():
            ratio = d["ratios"].get(f"jaxserve/{engine}")
            print(
                f"{name:9s} {engine:17s} {s['requests_per_s']:6.2f} "
                f"{s['output_tokens_per_s']:9.1f} {s['total_tokens_per_s']:9.1f} "
                f"{_ms(s['ttft_ms_p50'])} {_ms(s['ttft_ms_p99'])} {_ms(s['tpot_ms_p50'])} "
                f"{_ms(s['tpot_ms_p99'])} {_fmt(ratio, 6, 2)} "
                f"{_fmt(s.get('peak_kv_slot_utilization'), 7, 3)} "
                f"{_fmt(s.get('prefix_hit_rate'), 6, 3)} "
                f"{_fmt(s.get('ideal_prefix_hit_rate'), 6, 3)} "
                f"{_fmt(s.get('mfu_vs_matmul'), 5, 2)} "
                f"{_fmt(s.get('compilations_during_run'), 4, 0)}"
            )
    for name, d in report["datasets"].items():
        on_off = d.get("cache_on_off")
        if on_off:
            parts = [f"{e} {v:.2f}x" for e, v in on_off.items() if e != "work_ratio"]
            if "work_ratio" in on_off:
                parts.append(f"work ratio (FLOPs off / on) {on_off['work_ratio']:.2f}x")
            print(f"{name}: prefix caching on / off: " + ", ".join(parts))
    js = report["info"].get("jaxserve", {})
    print(
        f"\njaxserve warm-up: {js.get('warmup_s', 0):.1f} s, "
        f"{js.get('warmup_compilations')} compilations (+{js.get('warmup_run_compilations')} "
        "in the warm-up run); 'comp' = compilations during the timed run"
    )
    for g in report["goals"]:
        mark = "OK  " if g["holds"] else "MISS"
        print(f"  [{mark}] {g['goal']}: measured {g['measured']:.3g}")


def _ms(v) -> str:
    return f"{v:8.1f}" if v is not None else f"{'-':>8s}"


def _fmt(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}s}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--datasets", help="comma list of sharegpt,random,prefix (preset's default)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--baselines", help=f"comma list of {','.join(ALL_BASELINES)} or 'none'")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals (req/s) for jaxserve; inf = all at once",
    )
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-bracket",
        dest="bracket",
        action="store_false",
        help="do not rerun jaxserve at the end",
    )
    p.add_argument(
        "--cache",
        default=str(CACHE),
        help="where benchmark checkpoints (and the XLA compile cache) live",
    )
    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not use JAX's persistent compilation cache in <cache>/jax",
    )
    p.add_argument(
        "--async-scheduling",
        default="",
        help="comma list of on,off: jaxserve passes with async scheduling so, beside the "
        "plan's default (named jaxserve-async-on / -off)",
    )
    p.add_argument("--output", help="results JSON (default: bench/results/<preset file>)")
    args = p.parse_args(argv)
    modes = [m for m in args.async_scheduling.split(",") if m]
    if set(modes) - {"on", "off"}:
        p.error(f"--async-scheduling takes on and off, got {args.async_scheduling!r}")
    args.async_scheduling = [m == "on" for m in modes]
    preset = PRESETS[args.preset]
    args.datasets = args.datasets.split(",") if args.datasets else list(preset.datasets)
    if args.baselines is None:
        args.baselines = list(preset.baselines)
    else:
        args.baselines = [] if args.baselines == "none" else args.baselines.split(",")
    unknown = set(args.baselines) - set(ALL_BASELINES)
    if unknown:
        p.error(f"unknown baselines {sorted(unknown)}; choose from {ALL_BASELINES}")
    args.output = Path(args.output) if args.output else RESULTS / preset.output
    return args


def enable_compile_cache(folder: Path) -> None:
    """JAX's persistent compilation cache: a rerun's warm-up loads executables from disk
    instead of compiling them (tracing, and so the compilation counter, is unchanged)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> dict:
    apply_cpu_workarounds()  # before jax starts: it runs jax before building an engine
    args = parse_args(argv)
    if args.compile_cache:
        enable_compile_cache(Path(args.cache) / "jax")
    bench = Bench(args, PRESETS[args.preset])
    t0 = time.perf_counter()
    bench.run_all()
    bench.wall_s = time.perf_counter() - t0
    report = bench.save()
    print_table(report)
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
