"""MoE decode throughput against a dense model with the same ACTIVE parameters, side by side.

    python bench/moe_decode.py                 # prints a table, writes results/moe_decode.json
    python bench/moe_decode.py --preset tiny --out /tmp/m.json   # seconds (the smoke test)

Two random-weight checkpoints are written with transformers: a Mixtral (E experts, top-k, each
expert of width F) and a Mistral with the same attention, embeddings and layers whose MLP has
width k * F, so that one token runs the same number of weights through both (the MoE's router,
D x E per layer, aside). Each model gets one engine (public API only: jaxserve.LLM and
SamplingParams), an untimed warm-up generate of the same shapes, then --reps timed generates of
a decode-heavy batch (short prompts, long outputs, greedy, ignore_eos) at each batch size; the
best rep counts. The ratio is MoE / dense output tokens per second.

Memory traffic decides decode: a dense step reads its active weights once, an MoE step reads
every expert that any row of the batch routes to, all E of them once R * k >= E or so. The
"bound" column is the ratio those weight reads allow: dense params / (MoE params but the
experts + the experts a batch of R tokens is expected to reach, E * (1 - (1 - k / E) ** R) per
MoE layer, for uniform routing); a ratio near it means the MoE step costs what it must read.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _machine import git_state, loadavg, machine

RESULTS = Path(__file__).resolve().parent / "results"

PRESETS = {
    # D 256, 4 layers, 8 experts of F 512, top-2 (dense F 1024): ~25 M params in the MoE.
    "default": dict(
        model=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8),
        experts=8,
        top_k=2,
        expert_f=512,
        batch_sizes=(1, 8, 32, 128),
        prompt_len=16,
        max_tokens=64,
        reps=2,
    ),
    "tiny": dict(
        model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
        experts=4,
        top_k=2,
        expert_f=32,
        batch_sizes=(2,),
        prompt_len=4,
        max_tokens=4,
        reps=1,
    ),
}


def write_checkpoints(folder: Path, preset: dict) -> dict[str, Path]:
    """The MoE checkpoint and its dense twin (same everything, MLP width k * F)."""
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

    common = dict(
        preset["model"], num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512
    )
    moe = write_tiny_hf_checkpoint(
        folder / "moe",
        "mixtral",
        with_tokenizer=False,
        num_local_experts=preset["experts"],
        num_experts_per_tok=preset["top_k"],
        intermediate_size=preset["expert_f"],
        **common,
    )
    dense_f = preset["top_k"] * preset["expert_f"]
    dense = write_tiny_hf_checkpoint(
        folder / "dense", "mistral", with_tokenizer=False, intermediate_size=dense_f, **common
    )
    return {"moe": moe, "dense": dense}


def run_model(path: Path, preset: dict) -> dict:
    """Output tokens per second of each batch size (best of the reps), and the param counts."""
    from jaxserve import LLM, SamplingParams

    max_batch = max(preset["batch_sizes"])
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=16,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(64, max_batch * preset["prompt_len"]),
        max_model_len=preset["prompt_len"] + preset["max_tokens"] + 16,
        num_kv_blocks=max_batch * 8 + 1,
        warmup=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=preset["max_tokens"], ignore_eos=True)
    rows = {}
    for batch in preset["batch_sizes"]:
        prompts = [
            {"prompt_token_ids": [3 + (7 * i + j) % 1000 for j in range(preset["prompt_len"])]}
            for i in range(batch)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # compiles this batch's shapes
        best = None
        for _ in range(preset["reps"]):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best = max(best or 0.0, tokens / seconds)
        rows[str(batch)] = round(best, 2)
    return {"tokens_per_s": rows, **param_counts(path)}


def param_counts(path: Path) -> dict[str, int]:
    """All params (from shapes), the active ones (all but the experts a token skips), and
    the params of one expert across the MoE layers (0 for a dense model)."""
    from jaxserve.models import arch_config_from_hf, get_model

    arch = arch_config_from_hf(json.loads((path / "config.json").read_text()))
    total = get_model(arch).num_params()
    expert = 3 * arch.hidden_size * arch.moe_intermediate_size * len(arch.moe_layers)
    unused = (arch.num_experts - arch.num_experts_per_tok) * expert
    return {"num_params": total, "active_params": total - unused, "expert_params": expert}


def read_bound(moe: dict, dense: dict, preset: dict, batch: int) -> float:
    """dense weights / MoE weights a decode step of `batch` tokens reads (uniform routing)."""
    experts, k = preset["experts"], preset["top_k"]
    reached = experts * (1 - (1 - k / experts) ** batch)
    shared = moe["num_params"] - experts * moe["expert_params"]
    return dense["num_params"] / (shared + reached * moe["expert_params"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--reps", type=int, help="timed generates per batch size (default: preset)")
    p.add_argument(
        "--batch-sizes",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        help="comma list of decode batch sizes (default: preset's)",
    )
    p.add_argument("--out", default=str(RESULTS / "moe_decode.json"))
    args = p.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    if args.reps is not None:
        preset["reps"] = args.reps
    if args.batch_sizes is not None:
        preset["batch_sizes"] = args.batch_sizes
    load_before = loadavg()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp), preset)
        for name, path in paths.items():
            runs[name] = run_model(path, preset)
    ratios = {
        b: round(runs["moe"]["tokens_per_s"][b] / runs["dense"]["tokens_per_s"][b], 3)
        for b in runs["moe"]["tokens_per_s"]
    }
    bounds = {b: round(read_bound(runs["moe"], runs["dense"], preset, int(b)), 3) for b in ratios}
    print(f"{'batch':>6s} {'moe tok/s':>12s} {'dense tok/s':>12s} {'moe/dense':>10s} {'bound':>7s}")
    for b, ratio in ratios.items():
        moe, dense = runs["moe"]["tokens_per_s"][b], runs["dense"]["tokens_per_s"][b]
        print(f"{b:>6s} {moe:12.1f} {dense:12.1f} {ratio:10.3f} {bounds[b]:7.3f}")
    print(
        f"params: moe {runs['moe']['num_params']:,} ({runs['moe']['active_params']:,} active), "
        f"dense {runs['dense']['num_params']:,}"
    )
    report = {
        "preset": args.preset,
        "settings": {k: v for k, v in preset.items()},
        "runs": runs,
        "ratio_moe_over_dense": ratios,
        "weight_read_bound": bounds,
        "machine": machine({"before": load_before, "after": loadavg()}),
        "git": git_state(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
