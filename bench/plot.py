"""Plot bench/throughput.py's results: output tokens/s per engine per dataset, and jaxserve's
ratio over each other engine.

    pip install matplotlib        # or: pip install -e .[bench]
    python bench/plot.py                                   # results/throughput.json -> .png
    python bench/plot.py IN.json --output OUT.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_ORDER = (
    "jaxserve", "jaxserve-nocache", "static", "hf-transformers", "vllm", "vllm-nocache"
)  # fmt: skip
COLORS = {
    "jaxserve": "#1f77b4",
    "jaxserve-nocache": "#aec7e8",
    "static": "#ff7f0e",
    "hf-transformers": "#2ca02c",
    "vllm": "#d62728",
    "vllm-nocache": "#ff9896",
}


def _engines(report: dict) -> list[str]:
    seen = {e for d in report["datasets"].values() for e in d["engines"]}
    return [e for e in ENGINE_ORDER if e in seen] + sorted(seen - set(ENGINE_ORDER))


def _throughput_panel(ax, report: dict, datasets: list[str], engines: list[str]) -> None:
    """Grouped bars of output tokens/s per dataset, one per engine, with min..max whiskers."""
    width = 0.8 / len(engines)
    top = 0.0
    for i, engine in enumerate(engines):
        xs, ys, err = [], [], [[], []]
        for j, name in enumerate(datasets):
            s = report["datasets"][name]["engines"].get(engine)
            if s is not None:
                xs.append(j + (i - (len(engines) - 1) / 2) * width)
                ys.append(s["output_tokens_per_s"])
                # Repeated runs (jaxserve's bracketing): whiskers span their min..max.
                runs = s.get("runs_output_tokens_per_s") or [ys[-1]]
                err[0].append(ys[-1] - min(runs))
                err[1].append(max(runs) - ys[-1])
                top = max(top, max(runs))
        bars = ax.bar(
            xs,
            ys,
            width,
            label=engine,
            color=COLORS.get(engine),
            yerr=err,
            capsize=2,
            error_kw={"lw": 0.8},
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput (higher is better; whiskers: repeated runs)")
    ax.legend(fontsize=8, loc="upper center", ncol=3)


def _ratio_panel(ax, report: dict, datasets: list[str], engines: list[str]) -> None:
    """Grouped bars of jaxserve's output tokens/s over each other engine's, per dataset."""
    others = [e for e in engines if e != "jaxserve"]
    width = 0.8 / max(len(others), 1)
    top = 1.0
    for i, engine in enumerate(others):
        xs, ys = [], []
        for j, name in enumerate(datasets):
            r = report["datasets"][name]["ratios"].get(f"jaxserve/{engine}")
            if r is not None:
                xs.append(j + (i - (len(others) - 1) / 2) * width)
                ys.append(r)
                top = max(top, r)
        bars = ax.bar(xs, ys, width, label=f"jaxserve / {engine}", color=COLORS.get(engine))
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("jaxserve output tokens/s / engine's")
    ax.set_title("ratios (> 1: jaxserve faster)")
    ax.set_ylim(0, top * 1.35)
    ax.legend(fontsize=8, loc="upper center", ncol=2)


def plot(report: dict, output: Path) -> Path:
    """Two panels: grouped bars of output tokens/s, and jaxserve / engine ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(report["datasets"])
    engines = _engines(report)
    fig, (ax_tp, ax_ratio) = plt.subplots(1, 2, figsize=(13, 4.8))
    _throughput_panel(ax_tp, report, datasets, engines)
    _ratio_panel(ax_ratio, report, datasets, engines)
    model = report["model"]
    load = report["machine"]["loadavg"]
    fig.suptitle(
        f"{model['name']} ({model['num_params'] / 1e6:.0f}M params, fp32), "
        f"{report['machine']['cpus']} CPUs, load avg {load['start'][0]} -> "
        f"{load.get('end', ['?'])[0]}, {report['time']}",
        fontsize=9,
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="?", default=str(HERE / "results" / "throughput.json"))
    p.add_argument("--output", help="PNG path (default: the input with .png)")
    args = p.parse_args(argv)
    src = Path(args.input)
    out = Path(args.output) if args.output else src.with_suffix(".png")
    print(f"wrote {plot(json.loads(src.read_text()), out)}")


if __name__ == "__main__":
    main()
