"""bench/startup.py's experiment 6: a server's start, with and without background warm-up.

A server (AsyncLLM, as `jaxserve serve` builds it) from spawn to the first token of a short
request, then a long one (its prompt over the first stage's cap: prefilled in chunks while the
larger buckets compile), with enable_background_warmup off (every bucket compiled and run
before it serves) and on (the first stage only: engine/background_warmup.py). Cold: each mode
in a process of its own on an empty cache folder. Restarted: second processes on one warm
cache folder, the modes alternated ``repeats`` times (a linear drift hits both alike). Each
process waits for its warm-up to end before it exits, and reports the greedy tokens of both
requests: they must be the same in every process.
"""

from __future__ import annotations

import tempfile

# Token ids (the 57M checkpoint has no tokenizer), in every model's vocabulary.
SHORT_PROMPT = {"prompt_token_ids": [15, 87, 301, 42, 9]}
LONG_PROMPT = {"prompt_token_ids": [(37 * i + 11) % 900 + 3 for i in range(120)]}
MAX_TOKENS = 16
MODES = {"off": False, "on": True}


def server_start(engine: dict, run_child, repeats: int = 2) -> dict:
    """Experiment 6 (module docstring) for the engine arguments ``engine``; ``run_child``
    is startup.py's (spec, cache folder) -> the child's result."""
    spec = {"mode": "server", "engine": engine, "prompts": [SHORT_PROMPT, LONG_PROMPT],
            "max_tokens": MAX_TOKENS}  # fmt: skip
    keys = ("wall_s", "construct_s", "first_token_s", "spawn_to_first_token_s",
            "warmup_done_s", "requests", "engine", "cap_after_requests")  # fmt: skip
    runs: dict[str, dict[str, list]] = {"cold": {m: [] for m in MODES}, "restart": {}}
    runs["restart"] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="startup-server-") as warm:
        for mode, gate in MODES.items():
            print(f"  server, cold, background warm-up {mode} ...", flush=True)
            if gate:
                with tempfile.TemporaryDirectory(prefix="startup-server-cold-") as cold:
                    run = run_child({**spec, "gate": gate}, cold)
            else:  # this one fills the warm folder of the restarts
                run = run_child({**spec, "gate": gate}, warm)
            runs["cold"][mode].append(_keep(run, keys))
        order = []
        for r in range(repeats):
            order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
        for i, mode in enumerate(order):
            print(f"  server, restarted, background warm-up {mode} ({i + 1}/{len(order)}) ...",
                  flush=True)  # fmt: skip
            run = run_child({**spec, "gate": MODES[mode]}, warm)
            runs["restart"][mode].append(_keep(run, keys))
    tokens = {str(r["requests"][i]["tokens"]) for rs in runs.values() for m in rs.values()
              for r in m for i in range(2)}  # fmt: skip
    return {"engine": engine, "prompts": spec["prompts"], "max_tokens": MAX_TOKENS,
            "order": order, "runs": runs, "same_tokens": len(tokens) == 2,
            "summary": _summary(runs)}  # fmt: skip


def _keep(run: dict, keys: tuple[str, ...]) -> dict:
    run["spawn_to_first_token_s"] = run["times"]["first_token"] - run["spawn"]
    return {k: run[k] for k in keys if k in run}


def _mean(rows: list[dict], key: str, index: int | None = None) -> float | None:
    values = [r["requests"][index][key] if index is not None else r.get(key) for r in rows]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summary(runs: dict) -> dict:
    out = {}
    for phase, by_mode in runs.items():
        for mode, rows in by_mode.items():
            out[f"{phase}_{mode}"] = {
                "spawn_to_first_token_s": _mean(rows, "spawn_to_first_token_s"),
                "construct_s": _mean(rows, "construct_s"),
                "long_request_latency_s": _mean(rows, "latency_s", 1),
                "warmup_done_s": _mean(rows, "warmup_done_s"),
            }
        off, on = out[f"{phase}_off"], out[f"{phase}_on"]
        out[f"{phase}_ratio"] = on["spawn_to_first_token_s"] / off["spawn_to_first_token_s"]
    return out


def print_server(s: dict) -> None:
    """Section 6: first token of a server, background warm-up off and on."""
    print("6 a server's first token, background warm-up off / on "
          f"(tokens the same in every process: {s['same_tokens']})")  # fmt: skip
    head = f"  {'':34s} {'off':>9s} {'on':>9s} {'ratio':>7s}"
    print(head)
    sm = s["summary"]
    for phase in ("cold", "restart"):
        off, on = sm[f"{phase}_off"], sm[f"{phase}_on"]
        for key, label in (("spawn_to_first_token_s", "spawn to first token s"),
                           ("construct_s", "AsyncLLM(...) s"),
                           ("long_request_latency_s", "long request after it, s"),
                           ("warmup_done_s", "warm-up over, s after start")):  # fmt: skip
            a, b = off[key], on[key]
            ratio = f"{b / a:7.2f}" if a and b else f"{'':7s}"
            fa = f"{a:9.2f}" if a is not None else f"{'-':>9s}"
            fb = f"{b:9.2f}" if b is not None else f"{'-':>9s}"
            print(f"  {phase + ': ' + label:34s} {fa} {fb} {ratio}")
