"""bench/batch.py's goals and the table it prints."""

from __future__ import annotations

JAX_PATHS = ("generate", "run-batch", "generate-cli")  # must agree token for token


def goals(report: dict) -> list[dict]:
    out = []

    def goal(text: str, value, target: float, higher: bool = True) -> None:
        holds = value is not None and (value >= target if higher else value <= target)
        out.append({"goal": text, "target": target, "measured": value, "holds": bool(holds)})

    goal(
        "run-batch / LLM.generate output tok/s >= 0.95",
        report["paths"].get("run-batch", {}).get("x_generate"),
        0.95,
    )
    tok = report["token_ids"]["paths"]
    agree = [p for p in JAX_PATHS if p != "generate"]
    mismatches = None
    if all(p in tok for p in agree):
        mismatches = sum(tok[p]["mismatched_requests"] for p in agree)
    goal(
        "generate / run-batch / generate-cli: greedy token ids differ in 0 requests",
        mismatches,
        0,
        higher=False,
    )
    return out


def print_table(report: dict) -> None:
    ds = report["dataset"]
    print(
        f"\nmodel {report['model']}, {ds['num_requests']} requests (prompt mean "
        f"{ds['prompt_len_mean']:.0f}, output mean {ds['output_len_mean']:.0f}, "
        f"{ds['num_output_tokens']} output tokens), greedy, ignore_eos; "
        f"{report['machine']['cpus']} cores, load avg start "
        f"{report['machine']['loadavg']['start']} end {report['machine']['loadavg'].get('end')}"
    )
    head = (
        f"{'path':15s} {'out tokens':>10s} {'timed s':>8s} {'out tok/s':>9s} {'x gen':>6s} "
        f"{'build s':>7s} {'comp':>4s} {'ids !=':>6s}  timed part"
    )
    print(head)
    print("-" * (len(head) + 40))
    for name, r in report["paths"].items():
        if "failed" in r:
            print(f"{name:15s} FAILED: {r['failed']}")
            continue
        build = r.get("build_s")
        comp = r.get("compilations_during_run")
        print(
            f"{name:15s} {r['output_tokens']:10d} {r['elapsed_s']:8.2f} "
            f"{r['output_tokens_per_s']:9.1f} {_fmt(r.get('x_generate'), 6, 3)} "
            f"{_fmt(build, 7, 1)} {_fmt(comp, 4, 0)} {_fmt(r.get('token_id_mismatches'), 6, 0)}  "
            f"{r['timed']}"
        )
    ref = report["reference"]
    if ref["spread"] is not None:
        print(
            f"reference = mean of {ref['paths']} ({ref['output_tokens_per_s']:.1f} tok/s, "
            f"spread {ref['spread']:.1%})"
        )
    ray = report["ray"]
    if "skipped" in ray:
        print(f"ray: skipped: {ray['skipped']}")
    elif "actors_2_vs_1" in ray:
        print(
            f"ray: 2 actors / 1 actor = {ray['actors_2_vs_1']:.2f}x (wall incl. actor start and "
            f"engine builds; one build ~{ray.get('one_engine_build_s', float('nan')):.0f} s; "
            f"{report['machine']['cpus']} cores shared by the actors)"
        )
    print(
        "'build s': engine build + warm-up (run-batch: whole start-up before the job); 'comp': "
        "step compilations in the timed part;\n'ids !=': requests whose token ids differ from "
        "generate's"
    )
    for g in report["goals"]:
        mark = "OK  " if g["holds"] else "MISS"
        m = g["measured"]
        print(f"  [{mark}] {g['goal']}: measured {m if m is None else format(m, '.3g')}")


def _fmt(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}s}"
