"""The peers_quality benchmark's chart: mean KL to the float model against quantization seconds, both on log axes,
one colour per series (a side at a width), each point labelled with its method and drawn with its +- one standard
error bar."""

from __future__ import annotations

import html
import math

from jgptq.plot import COLORS, legend_frame


def _decades(lo: float, hi: float) -> list:
    """Tick values 10^k, 2*10^k, 5*10^k covering [lo, hi] (positive); the powers of ten first."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return [(m * 10.0 ** k, m == 1) for k in range(a, b + 1) for m in (1, 2, 5)
            if lo <= m * 10.0 ** k <= hi]


def kl_seconds_chart(series: dict, *, title: str) -> str:
    """SVG scatter: series name -> list of (seconds, kl_mean, kl_stderr, label); non-positive values are left out.

    Raises:
      ValueError: no point to draw.
    """
    pts = [(s, k) for rows in series.values() for s, k, _, _ in rows if s > 0 and k > 0]
    if not pts:
        raise ValueError("kl_seconds_chart: nothing to draw")
    frame = legend_frame(series)
    xs, ys = [math.log10(s) for s, _ in pts], [math.log10(k) for _, k in pts]
    x0, x1 = math.floor(min(xs) * 4) / 4 - 0.1, math.ceil(max(xs) * 4) / 4 + 0.25   # room for the labels
    y0, y1 = math.floor(min(ys)) - 0.0, math.ceil(max(ys)) if math.ceil(max(ys)) > math.floor(min(ys)) else \
        math.floor(min(ys)) + 1
    left, top, pw, ph = frame.left, frame.top, frame.pw, frame.ph

    def px(v):
        return left + (math.log10(v) - x0) / (x1 - x0) * pw

    def py(v):
        return top + ph - (math.log10(max(v, 10 ** y0)) - y0) / (y1 - y0) * ph

    out = frame.head(title)
    for v, major in _decades(10 ** y0, 10 ** y1):
        y = py(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="'
                   f'{"#ccc" if major else "#eee"}"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.0e}</text>')
    for v, major in _decades(10 ** x0, 10 ** x1):
        x = px(v)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="'
                   f'{"#ccc" if major else "#eee"}"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{v:g}</text>')
    out += frame.axes("quantization seconds (log)", "mean KL to the float model (log), +- 1 s.e.")
    for k, (name, rows) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        for s, kl, se, label in rows:
            if not (s > 0 and kl > 0):
                continue
            x, y = px(s), py(kl)
            if se and se > 0:
                out.append(f'<line x1="{x:.1f}" y1="{py(kl + se):.1f}" x2="{x:.1f}" y2="{py(kl - se):.1f}" '
                           f'stroke="{color}"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"><title>'
                       f'{html.escape(f"{name} {label}: KL {kl:.3g} +- {se:.2g}, {s:.0f} s")}</title></circle>')
            out.append(f'<text x="{x + 6:.1f}" y="{y - 5:.1f}" font-size="10" fill="{color}">'
                       f'{html.escape(label)}</text>')
        out += frame.legend(k, name, color)
    out.append("</svg>")
    return "\n".join(out) + "\n"
