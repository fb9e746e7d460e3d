"""Render a preview of the Grafana dashboard from live /metrics scrapes, with matplotlib.

    python -m minisgl.server &
    python scripts/dashboard_preview.py --base-url http://127.0.0.1:1919 --duration-s 120 \\
        --out docs/images/dashboard_preview.png &
    python benchmark/online/bench_serving.py --dataset shared-prefix --request-rate 1

This is not Grafana and not a screenshot of it: it scrapes /metrics every --interval-s seconds
(as Prometheus would), evaluates each panel's PromQL from
examples/monitoring/grafana/dashboards/minisgl.json with a small evaluator that knows only what
that dashboard uses (selectors, rate, sum/max [by], histogram_quantile, `/`), and draws the
panels in the dashboard's layout. `rate` here is the plain slope over the window, without
Prometheus' extrapolation at the window's edges. Use it to see what the dashboard shows without
running Docker; the picture says it is a preview.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "monitoring" / "grafana" / "dashboards" / "minisgl.json"
GRID_COLUMNS = 24  # Grafana's grid width
RATE_INTERVAL_SCRAPES = 4  # Grafana's $__rate_interval: four scrape intervals
INCH_PER_GRID_ROW = 0.3
FIGURE_WIDTH_IN = 16.0
DPI = 60
PNG_COLORS = 64
TITLE_GRID_ROWS = 1  # grid rows above each panel's plot, for its title
AXIS_GRID_ROWS = 1  # grid rows below it, for its x axis
SCRAPE_TIMEOUT_S = 10.0
BYTES_PER_GIB = float(1 << 30)
PREVIEW_NOTE = (
    "Preview rendered with matplotlib from live /metrics scrapes (not a Grafana screenshot)"
)

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_TOKEN = re.compile(r'\s*(\d+\.\d+|\d+|[a-zA-Z_:][a-zA-Z0-9_:]*|"[^"]*"|=~|!=|[(){}\[\],=/]|\$\w+)')


def parse_scrape(text: str) -> dict[tuple[str, Labels], float]:
    series = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
            series[(match.group(1), labels)] = float(match.group(3))
    return series


@dataclass
class Scrapes:
    times_s: list[float]
    samples: list[dict[tuple[str, Labels], float]]
    rate_window_s: float


class Evaluator:
    """Evaluates the dashboard's PromQL at one scrape; an unknown construct raises ValueError."""

    def __init__(self, scrapes: Scrapes, index: int) -> None:
        self.scrapes = scrapes
        self.index = index
        self.tokens: list[str] = []
        self.pos = 0

    def evaluate(self, query: str) -> Vector:
        query = query.replace("$__rate_interval", "rate_interval")
        self.tokens = _TOKEN.findall(query)
        if "".join(self.tokens) != re.sub(r"\s+", "", query):
            raise ValueError(f"cannot tokenize {query!r}")
        self.pos = 0
        result = self._expr()
        if self.pos != len(self.tokens):
            raise ValueError(f"trailing tokens in {query!r}: {self.tokens[self.pos :]}")
        return result

    def _peek(self) -> str:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ""

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r}")
        self.pos += 1
        return token

    def _expr(self) -> Vector:
        left = self._term()
        while self._peek() == "/":
            self._take()
            right = self._term()
            left = {
                labels: value / right[labels] if right[labels] else math.nan
                for labels, value in left.items()
                if labels in right
            }
        return left

    def _term(self) -> Vector:
        token = self._take()
        if token in ("sum", "max"):
            by: tuple[str, ...] = ()
            if self._peek() == "by":
                self._take()
                by = self._label_list()
            self._take("(")
            inner = self._expr()
            self._take(")")
            return _aggregate(inner, by, sum if token == "sum" else max)
        if token == "rate":
            self._take("(")
            name, matchers = self._selector()
            self._take("[")
            self._take("rate_interval")
            self._take("]")
            self._take(")")
            return self._rate(name, matchers)
        if token == "histogram_quantile":
            self._take("(")
            q = float(self._take())
            self._take(",")
            inner = self._expr()
            self._take(")")
            return _histogram_quantile(q, inner)
        self.pos -= 1
        name, matchers = self._selector()
        return self._select(self.index, name, matchers)

    def _label_list(self) -> tuple[str, ...]:
        self._take("(")
        labels = [self._take()]
        while self._peek() == ",":
            self._take()
            labels.append(self._take())
        self._take(")")
        return tuple(labels)

    def _selector(self) -> tuple[str, list[tuple[str, str, str]]]:
        name = self._take()
        matchers = []
        if self._peek() == "{":
            self._take()
            while self._peek() != "}":
                label, op, value = self._take(), self._take(), self._take()
                # Dashboard variables select everything: one server is scraped here.
                matchers.append((label, op, ".*" if value == '"$instance"' else value.strip('"')))
                if self._peek() == ",":
                    self._take()
            self._take("}")
        return name, matchers

    def _select(self, index: int, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
        out: Vector = {}
        for (series_name, labels), value in self.scrapes.samples[index].items():
            if series_name == name and all(_matches(labels, m) for m in matchers):
                out[labels] = value
        return out

    def _rate(self, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
        now_s = self.scrapes.times_s[self.index]
        first = self.index
        while first > 0 and now_s - self.scrapes.times_s[first - 1] <= self.scrapes.rate_window_s:
            first -= 1
        if first == self.index:
            return {}
        elapsed_s = now_s - self.scrapes.times_s[first]
        start, end = self._select(first, name, matchers), self._select(self.index, name, matchers)
        return {
            labels: (end[labels] - start[labels]) / elapsed_s for labels in end if labels in start
        }


def _matches(labels: Labels, matcher: tuple[str, str, str]) -> bool:
    label, op, pattern = matcher
    value = dict(labels).get(label, "")
    if op == "=":
        return value == pattern
    if op == "!=":
        return value != pattern
    if op == "=~":
        return re.fullmatch(pattern, value) is not None
    raise ValueError(f"matcher {op!r}")


def _aggregate(vector: Vector, by: tuple[str, ...], combine: Any) -> Vector:
    groups: dict[Labels, list[float]] = defaultdict(list)
    for labels, value in vector.items():
        groups[tuple((k, v) for k, v in labels if k in by)].append(value)
    return {labels: combine(values) for labels, values in groups.items()}


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' interpolation inside the bucket that holds the q-th observation."""
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, count in buckets.items():
        rest = tuple((k, v) for k, v in labels if k != "le")
        groups[rest].append((float(dict(labels)["le"]), count))
    out: Vector = {}
    for labels, points in groups.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            out[labels] = math.nan
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in points:
            if count >= rank:
                if math.isinf(bound):
                    out[labels] = lower_bound
                else:
                    share = (
                        (rank - lower_count) / (count - lower_count) if count > lower_count else 0
                    )
                    out[labels] = lower_bound + (bound - lower_bound) * share
                break
            lower_bound, lower_count = bound, count
    return out


def save_scrapes(scrapes: Scrapes, path: Path) -> None:
    samples = [
        [[name, [list(pair) for pair in labels], value] for (name, labels), value in sample.items()]
        for sample in scrapes.samples
    ]
    data = {"times_s": scrapes.times_s, "rate_window_s": scrapes.rate_window_s, "samples": samples}
    path.write_text(json.dumps(data))


def load_scrapes(path: Path) -> Scrapes:
    data = json.loads(path.read_text())
    samples = [
        {(name, tuple(tuple(pair) for pair in labels)): value for name, labels, value in sample}
        for sample in data["samples"]
    ]
    return Scrapes(data["times_s"], samples, data["rate_window_s"])


def scrape(base_url: str, duration_s: float, interval_s: float) -> Scrapes:
    times_s, samples = [], []
    start_s = time.monotonic()
    with httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client:
        while time.monotonic() - start_s < duration_s:
            tick_s = time.monotonic()
            samples.append(parse_scrape(client.get(base_url + "/metrics").text))
            times_s.append(tick_s - start_s)
            time.sleep(max(0.0, interval_s - (time.monotonic() - tick_s)))
    return Scrapes(times_s, samples, RATE_INTERVAL_SCRAPES * interval_s)


def panel_series(scrapes: Scrapes, panel: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """(legend, value at every scrape) for each series of each target of a panel."""
    lines: dict[str, list[float]] = {}
    for target in panel.get("targets", []):
        per_scrape = [
            Evaluator(scrapes, i).evaluate(target["expr"]) for i in range(len(scrapes.times_s))
        ]
        keys = sorted({labels for vector in per_scrape for labels in vector})
        for labels in keys:
            legend = _legend(target["legendFormat"], labels)
            lines[legend] = [vector.get(labels, math.nan) for vector in per_scrape]
    return list(lines.items())


def _legend(legend_format: str, labels: Labels) -> str:
    """Grafana's `{{label}}` placeholders filled in."""
    values = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), legend_format)


def _scaled(unit: str, values: list[float]) -> tuple[list[float], str]:
    if unit == "percentunit":
        return [v * 100 for v in values], "%"
    if unit == "bytes":
        return [v / BYTES_PER_GIB for v in values], "GiB"
    if unit == "s":
        return [v * 1000 for v in values], "ms"
    return values, {"reqps": "req/s", "short": ""}.get(unit, unit)


def save_small_png(fig: Any, out: Path) -> None:
    """Line plots need few colours: a 64-colour palette PNG is about a third of the size."""
    from PIL import Image  # a matplotlib dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=PNG_COLORS).save(out, optimize=True)


def render(scrapes: Scrapes, dashboard: dict[str, Any], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    grid_rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(FIGURE_WIDTH_IN, grid_rows * INCH_PER_GRID_ROW), dpi=DPI)
    fig.subplots_adjust(left=0.04, right=0.99, top=0.95, bottom=0.02)
    grid = fig.add_gridspec(grid_rows, GRID_COLUMNS, hspace=0.0, wspace=2.5)
    fig.suptitle(f"{title}\n{PREVIEW_NOTE}", fontsize=13)
    end_s = scrapes.times_s[-1] if scrapes.times_s else 1.0
    for panel in panels:
        pos = panel["gridPos"]
        top, bottom = pos["y"], pos["y"] + pos["h"]
        columns = slice(pos["x"], pos["x"] + pos["w"])
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[top:bottom, columns])
            ax.axis("off")
            ax.text(0, 0.5, panel["title"], fontsize=12, fontweight="bold", va="center")
            continue
        ax = fig.add_subplot(grid[top + TITLE_GRID_ROWS : bottom - AXIS_GRID_ROWS, columns])
        ax.set_title(panel["title"], fontsize=10, loc="left")
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        drawn = False
        for legend, values in panel_series(scrapes, panel):
            scaled, unit_label = _scaled(unit, values)
            ax.set_ylabel(unit_label, fontsize=8)
            if any(math.isfinite(v) for v in scaled):
                ax.plot(scrapes.times_s, scaled, label=legend, linewidth=1.2)
                drawn = True
        ax.set_xlim(0, end_s)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
    save_small_png(fig, out)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--interval-s", type=float, default=2.0, help="scrape interval")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--title", default="minisgl dashboard")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--save-scrapes", type=Path, default=None, help="keep the scrapes (JSON)")
    p.add_argument("--from-scrapes", type=Path, default=None, help="draw saved scrapes instead")
    args = p.parse_args()
    dashboard = json.loads(args.dashboard.read_text())
    if args.from_scrapes is not None:
        scrapes = load_scrapes(args.from_scrapes)
    else:
        scrapes = scrape(args.base_url.rstrip("/"), args.duration_s, args.interval_s)
    if args.save_scrapes is not None:
        save_scrapes(scrapes, args.save_scrapes)
    render(scrapes, dashboard, args.out, args.title)
    print(f"wrote {args.out} from {len(scrapes.times_s)} scrapes")


if __name__ == "__main__":
    main()
