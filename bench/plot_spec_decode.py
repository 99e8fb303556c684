"""Plot bench/spec_decode.py's results: output tok/s against the plain engine (x plain, same
run) by batch size, one line per method, a panel per workload.

    pip install matplotlib        # or: pip install -e .[bench]
    python bench/plot_spec_decode.py                        # results/spec_decode.json -> .png
    python bench/plot_spec_decode.py IN.json --output OUT.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def plot(report: dict, output: Path) -> Path:
    """A panel per workload: x plain by batch size (log scale), a line per engine, and the
    break-even line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        engines = sorted({r["engine"] for r in rows if r["workload"] == workload})
        for engine in engines:
            points = sorted(
                (r["batch"], r["ratio"])
                for r in rows
                if r["workload"] == workload and r["engine"] == engine
            )
            ax.plot(*zip(*points, strict=True), marker="o", label=engine)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests in flight)")
        ax.set_ylabel("output tok/s, x plain (same run)")
        ax.set_title(f"{workload} (preset {report['preset']}, k = {report['k']})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="?", default=str(HERE / "results" / "spec_decode.json"))
    p.add_argument("--output")
    args = p.parse_args(argv)
    src = Path(args.input)
    return plot(json.loads(src.read_text()), Path(args.output or src.with_suffix(".png")))


if __name__ == "__main__":
    print(main())
