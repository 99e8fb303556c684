"""bench/serve.py's ServeBench: every server and rate of one run, in order, and the
report it saves."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _baselines  # noqa: E402
import _datasets  # noqa: E402
from _jaxserve_runs import poisson_arrivals  # noqa: E402
from _machine import git_state, loadavg, machine  # noqa: E402
from _serve_load import _run_load, summarize  # noqa: E402
from _serve_offline import (  # noqa: E402
    OfflineWorker,
    _cpu_delta,
    _own_cpu_seconds,
    _round_rate,
    group_cpu_seconds,
)
from _serve_presets import INF, TTFT_SLO_S, WARM_UP_MAX_TOKENS, ServePreset  # noqa: E402
from _serve_report import (  # noqa: E402
    _by_rate,
    _client_version,
    _json_safe,
    _log_facts,
    _ms,
    _rate_str,
    _saturation_key,
    compare,
    goals,
    next_search_rate,
)
from _serve_servers import ServerProcess, free_port, jaxserve_command, prepare_model, vllm_command  # noqa: E402


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
        if name in ("jaxserve", "jaxserve-sync"):
            # "jaxserve" leaves async scheduling to the plan unless "jaxserve-sync" runs too.
            on = None
            if name == "jaxserve-sync":
                on = False
            elif "jaxserve-sync" in a.servers:
                on = True
            cmd = jaxserve_command(model, engine, port, self.cache / "jax", a.seed, on)
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
