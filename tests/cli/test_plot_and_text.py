"""The SVG chart and the calibration text helpers of the command line."""

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from jgptq_torch.pipeline import calib
from jgptq.plot import line_chart

SVG = "{http://www.w3.org/2000/svg}"


def points(svg: str) -> list:
    root = ET.fromstring(svg)
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for line in root.iter(f"{SVG}polyline")]


def test_chart_places_values_by_log_scale_and_skips_what_it_cannot_draw():
    svg = line_chart({"a": [1e-3, 1e-2, 1e-1], "b": [1e-3, float("nan"), 0.0]}, log_y=True, title="t<&>")
    (a,) = points(svg)                                  # b keeps one point: no line, one marker
    assert len(ET.fromstring(svg).findall(f"{SVG}circle")) == 4
    xs, ys = zip(*a)
    assert xs[0] < xs[1] < xs[2] and ys[0] > ys[1] > ys[2]        # larger values are higher up
    assert math.isclose(ys[0] - ys[1], ys[1] - ys[2], rel_tol=1e-3)  # equal ratios, equal steps
    assert "t&lt;&amp;&gt;" in svg
    linear = points(line_chart({"a": [0.0, 1.0, 4.0]}))[0]
    assert math.isclose((linear[0][1] - linear[1][1]) * 4, linear[0][1] - linear[2][1], rel_tol=1e-3)
    with pytest.raises(ValueError, match="no finite value"):
        line_chart({"a": [float("nan")]})
    with pytest.raises(ValueError, match="different lengths"):
        line_chart({"a": [1.0], "b": [1.0, 2.0]})


class Bytes:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode())}


def test_token_windows_are_evenly_spaced_slices_of_the_text(tmp_path):
    text = "".join(chr(97 + i % 26) for i in range(1000))
    w = calib.token_windows([text], Bytes(), 100, 4)
    ids = torch.tensor(list(text.encode()))
    assert w.shape == (4, 100) and all(torch.equal(w[k], ids[k * 250 // 100 * 100:][:100]) for k in range(4))
    assert calib.token_windows(["short"], Bytes(), 100, 4).tolist() == [list(b"short")]
    assert calib.token_windows([text], Bytes(), 100, 50).shape == (10, 100)
    with pytest.raises(ValueError, match="no tokens"):
        calib.token_windows(["   "], Bytes(), 10, 1)
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.md").write_text("not read")
    assert calib.read_texts(tmp_path) == ["first", "second"]
