"""bench/startup.py's goals (issue 35's, README's first command's and each experiment's), each
with its value from the experiments that ran."""

from __future__ import annotations

import _startup_vllm as vllm_side


def _goal(text: str, value, threshold, op: str, note: str = "") -> dict:
    passed = {"<=": value <= threshold, ">=": value >= threshold, "==": value == threshold}[op]
    out = {"goal": text, "value": value, "threshold": threshold, "op": op, "passed": passed}
    if note:
        out["note"] = note
    return out


def goals(report: dict) -> dict:
    """The goals of the experiments that ran."""
    out = {}
    if "demo" in report:
        d = report["demo"]
        first, second = (run["wall_s"] for run in d["runs"])
        out["demo_first_wall"] = _goal(
            "README's first command: first process <= 30 s wall", first, 30.0, "<="
        )
        out["demo_second_wall"] = _goal(
            "README's first command: second process <= 8 s wall", second, 8.0, "<="
        )
        out["demo_second_wall_ratio"] = _goal(
            "demo: second process wall <= 1/3 of the first", d["wall_ratio"], 1 / 3, "<="
        )
        out["demo_second_fresh_compilations"] = _goal(
            "demo: 0 fresh compilations in the second process (engine count)",
            d["runs"][1]["engine"]["fresh"], 0, "==",
        )  # fmt: skip
    if "construct" in report:
        out["construct_second_ratio"] = _goal(
            "LLM(warmup=True) construction: second process <= 25% of the first",
            report["construct"]["construct_ratio"], 0.25, "<=",
        )  # fmt: skip
    if "workers" in report:
        w = report["workers"]
        on_cpu = report["machine"]["jax_backend"] == "cpu"
        note = (
            f"a CPU with {w['cpu_count']} cores: XLA's CPU compiler already uses them for one "
            "compilation, ~1x expected; the goal is for accelerators"
        )
        out["concurrent_warmup_speedup"] = _goal(
            f"first warm-up: workers={w['workers']} at least 2x faster than workers=1",
            w["speedup"], 2.0, ">=", note=note if on_cpu else "",
        )  # fmt: skip
    if "features" in report:
        out["feature_compilations_after_warmup"] = _goal(
            "every SamplingParams feature: 0 compilations (fresh or cached) after warm-up",
            report["features"]["total_after_warmup"], 0, "==",
        )  # fmt: skip
    if "server" in report:
        for name, srv in report["server"].items():
            out[f"server_{name}_restart_ratio"] = _goal(
                f"{name}: restarted server's first token, background warm-up on <= 0.5x off",
                srv["summary"]["restart_ratio"], 0.5, "<=",
            )  # fmt: skip
            out[f"server_{name}_same_tokens"] = _goal(
                f"{name}: the same greedy tokens with and without background warm-up",
                int(srv["same_tokens"]), 1, "==",
            )  # fmt: skip
    big = report.get("phases", {}).get("models", {}).get("57m")
    if big is not None:
        out.update(vllm_side.goals(big, report["phases"]["vllm"], _goal))
    return out
