"""Plot throughput and latency percentiles from benchmark result files into one PNG.

    python benchmark/plot.py radix.jsonl naive.jsonl --out radix_vs_naive.png
    python benchmark/plot.py on.jsonl off.jsonl --labels "overlap on,overlap off" --x scale

Each file holds the JSON lines that bench_qwen.py or bench_serving.py append (one per run) and
becomes one line in every panel, with one point per run, sorted along the x axis. Panels: output
throughput, TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed). The x axis is a field of
the results: `request_rate` (default; offered req/s), `scale`, `max_concurrency`, ...
"""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

FIGURE_SIZE_IN = (10.0, 7.5)
DPI = 80  # 800 x 600 pixels: small enough to commit
PNG_COLORS = 64
# (panel title, y label, [(result field, line style, suffix)])
PANELS = (
    ("Output throughput", "tokens/s", [("output_throughput", "-", "")]),
    ("Time to first token", "ms", [("p50_ttft_ms", "-", " p50"), ("p99_ttft_ms", "--", " p99")]),
    ("Time per output token", "ms", [("p50_tpot_ms", "-", " p50"), ("p99_tpot_ms", "--", " p99")]),
    ("End-to-end latency", "ms", [("p50_e2el_ms", "-", " p50"), ("p99_e2el_ms", "--", " p99")]),
)
X_LABELS = {
    "request_rate": "offered request rate (req/s)",
    "scale": "trace time scale (smaller: faster arrivals)",
    "max_concurrency": "max concurrency",
}


def load_results(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def save_small_png(fig: Any, out: Path) -> None:
    """Line plots need few colours: a 64-colour palette PNG is about a third of the size."""
    from PIL import Image  # a matplotlib dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=PNG_COLORS).save(out, optimize=True)


def plot(
    files: list[Path], labels: list[str], x_key: str, out: Path, title: str | None = None
) -> None:
    fig, axes = plt.subplots(2, 2, figsize=FIGURE_SIZE_IN, dpi=DPI)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (path, label) in enumerate(zip(files, labels, strict=True)):
        records = [r for r in load_results(path) if math.isfinite(_number(r.get(x_key)))]
        if not records:
            raise SystemExit(f"{path}: no result with a numeric `{x_key}`")
        records.sort(key=lambda r: _number(r[x_key]))
        xs = [_number(r[x_key]) for r in records]
        color = colors[index % len(colors)]
        for ax, (_, _, series) in zip(axes.flat, PANELS, strict=True):
            for field, style, suffix in series:
                ys = [_number(r.get(field)) for r in records]
                ax.plot(xs, ys, style, marker="o", color=color, label=label + suffix)
    for ax, (panel_title, y_label, _) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(panel_title)
        ax.set_xlabel(X_LABELS.get(x_key, x_key))
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_small_png(fig, out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="JSON-lines result files")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--x", dest="x_key", default="request_rate", help="result field for the x axis")
    p.add_argument("--labels", default=None, help="comma-separated, one per file")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    if args.labels is not None:
        labels = args.labels.split(",")
        if len(labels) != len(args.files):
            raise SystemExit("--labels needs one label per file")
    else:  # the runs' own --label, else the file name
        labels = []
        for path in args.files:
            first = next(iter(load_results(path)), {})
            labels.append(first.get("label") or path.stem)
    plot(args.files, labels, args.x_key, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
