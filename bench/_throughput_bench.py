"""bench/throughput.py's run: one warmed-up jaxserve engine and the baselines, stage by stage,
on every dataset, and the report gathered from their results.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import _baselines
import _datasets
import _jaxserve_runs
from _machine import git_state, loadavg, machine
from _metrics import ModelShape, RunResult, machine_limits, utilization
from _throughput_presets import Preset, ensure_checkpoint
from _throughput_report import cache_on_off, goals, mean_summary, ratios, versions


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
                s = mean_summary(summaries)
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
                "ratios": ratios(engines),
                "cache_on_off": cache_on_off(engines),
                "timings": {e: [r.timings_json() for r in rs] for e, rs in self.runs[name].items()},
            }
        report = {
            "preset": self.args.preset,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(self.load),
            "git": git_state(),
            "versions": versions(),
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
