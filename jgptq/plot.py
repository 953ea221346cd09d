"""A small SVG line chart (no plotting library needed): per-layer figures of a quantization run.

:class:`Frame` draws what every chart of the project shares (page, title, plot box, axis labels, legend rows);
:func:`line_chart` and the benchmarks' charts fill it.

Example::

    svg = line_chart({"RTN": [0.1, 0.2], "GPTQ": [0.05, 0.08]}, title="output error", xlabel="layer",
                     ylabel="relative error", log_y=True)
    open("loss.svg", "w").write(svg)
"""

from __future__ import annotations

import dataclasses
import html
import math

COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 78, 150, 40, 52


@dataclasses.dataclass(frozen=True)
class Frame:
    """A chart's page: its size and margins; the plot box is what the margins leave (``pw`` x ``ph``)."""

    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right: int = RIGHT
    top: int = TOP
    bottom: int = BOTTOM

    @property
    def pw(self) -> int:
        return self.width - self.left - self.right

    @property
    def ph(self) -> int:
        return self.height - self.top - self.bottom

    def head(self, title: str) -> list:
        """The SVG's opening lines: the page, a white ground, the title."""
        return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="sans-serif" font-size="12">',
                f'<rect width="{self.width}" height="{self.height}" fill="white"/>',
                f'<text x="{self.left + self.pw / 2}" y="22" text-anchor="middle" font-size="15">'
                f'{html.escape(title)}</text>']

    def axes(self, xlabel: str, ylabel: str) -> list:
        """The plot box and the two axis labels."""
        return [f'<rect x="{self.left}" y="{self.top}" width="{self.pw}" height="{self.ph}" fill="none" '
                f'stroke="#444"/>',
                f'<text x="{self.left + self.pw / 2}" y="{self.height - 12}" text-anchor="middle">'
                f'{html.escape(xlabel)}</text>',
                f'<text transform="translate(18 {self.top + self.ph / 2}) rotate(-90)" text-anchor="middle">'
                f'{html.escape(ylabel)}</text>']

    def legend(self, k: int, name: str, color: str) -> list:
        """Row ``k`` of the legend right of the plot box: a line of the series' colour and its name."""
        ly = self.top + 14 + 20 * k
        x = self.left + self.pw
        return [f'<line x1="{x + 14}" y1="{ly - 4}" x2="{x + 38}" y2="{ly - 4}" stroke="{color}" stroke-width="2"/>',
                f'<text x="{x + 44}" y="{ly}">{html.escape(name)}</text>']


def _ticks(lo: float, hi: float, log: bool) -> list:
    if log:
        a, b = math.floor(lo), math.ceil(hi)
        step = max(1, math.ceil((b - a) / 6))
        return [float(k) for k in range(a, b + 1, step)]
    if hi == lo:
        return [lo]
    raw = (hi - lo) / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, log: bool) -> str:
    return f"1e{int(v)}" if log else f"{v:.3g}"


CHAR_WIDTH = 7.5   # an upper bound of the mean width of a 12 px sans-serif character, for the legend's room


def legend_frame(names) -> Frame:
    """A :class:`Frame` whose right margin holds the longest legend name and whose height holds every legend row
    (the default frame when they fit in it)."""
    longest = max((len(str(n)) for n in names), default=0)
    right = max(RIGHT, 56 + math.ceil(CHAR_WIDTH * longest))
    height = max(HEIGHT, TOP + 14 + 20 * len(names) + 8)
    return Frame(width=WIDTH - RIGHT + right, height=height, right=right)


def line_chart(series: dict, *, title: str = "", xlabel: str = "", ylabel: str = "", log_y: bool = False,
               x: list | None = None, y_ticks: list | None = None) -> str:
    """An SVG document with one line per series.

    Args:
      series: name -> list of floats (equal lengths; NaN and, with ``log_y``, non-positive values are skipped).
      title, xlabel, ylabel: text.
      log_y: logarithmic y axis.
      x: x values (default 0, 1, 2, ...).
      y_ticks: the y values to label (default: evenly spaced round values); the axis spans them too.
    Returns:
      The SVG text.
    Raises:
      ValueError: no finite value to draw, or series of different lengths.
    """
    lengths = {len(v) for v in series.values()}
    if len(lengths) != 1:
        raise ValueError(f"line_chart: series have different lengths {sorted(lengths)}")
    n = lengths.pop()
    xs = list(x) if x is not None else list(range(n))

    def ok(v):
        return v is not None and math.isfinite(v) and (v > 0 or not log_y)

    def ty(v):
        return math.log10(v) if log_y else v

    values = [ty(v) for vals in series.values() for v in vals if ok(v)]
    if not values:
        raise ValueError("line_chart: no finite value to draw")
    if y_ticks:
        values += [ty(v) for v in y_ticks if ok(v)]
    lo, hi = min(values), max(values)
    if log_y:
        lo, hi = math.floor(lo), math.ceil(hi) if math.ceil(hi) > math.floor(lo) else math.floor(lo) + 1
    elif hi == lo:
        lo, hi = lo - 1, hi + 1
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = 0.04 * (x1 - x0)
    x0, x1 = x0 - pad, x1 + pad
    frame = legend_frame(list(series))
    pw, ph = frame.pw, frame.ph

    def px(v):
        return LEFT + (v - x0) / (x1 - x0) * pw

    def py(v):
        return TOP + ph - (v - lo) / (hi - lo) * ph

    out = frame.head(title)
    ticks = _ticks(lo, hi, log_y) if not y_ticks else sorted(ty(v) for v in y_ticks if ok(v))
    for t in ticks:
        if lo - 1e-9 <= t <= hi + 1e-9:
            y = py(t)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#ddd"/>')
            label = _label(t, log_y) if not y_ticks else f"{10 ** t if log_y else t:.3g}"
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    step = max(1, math.ceil(len(xs) / 12))
    for v in xs[::step]:
        out.append(f'<text x="{px(v):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{v}</text>')
    out += frame.axes(xlabel, ylabel)
    for k, (name, vals) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        points = [(px(xv), py(ty(v))) for xv, v in zip(xs, vals) if ok(v)]
        if len(points) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3.5" fill="{color}"/>' for a, b in points]
        out += frame.legend(k, name, color)
    out.append("</svg>")
    return "\n".join(out) + "\n"
