"""The output writer benchmark's smoke run: the previous packer, today's on one thread and on a pool write the same
folder, and the figures it reports are consistent."""

import json

import numpy as np

from benchmarks import checkpoint_writer as cw
from jgptq.export import packing


def test_previous_packer_is_todays_for_whole_byte_widths():
    rng = np.random.default_rng(0)
    for bits in (1, 2, 4, 8):
        v = rng.integers(0, 1 << bits, (7, 300), dtype=np.uint8)
        for axis in (0, 1):
            assert np.array_equal(cw.previous_pack_int32(v, bits, axis), packing.pack_int32(v, bits, axis))


def test_small_run_writes_identical_folders(tmp_path):
    out = tmp_path / "r.json"
    assert cw.main(["--small", "--repeat", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["variants"]) == {"previous", "new_1", "new_pool"}
    assert r["variants"]["new_1"]["identical_to_previous"] and r["variants"]["new_pool"]["identical_to_previous"]
    assert r["variants"]["new_pool"]["workers"] >= 2
    assert r["breakdown"]["written_bytes"] > r["code_bytes"] // 2            # int4 codes: half a byte each, + scales
    assert r["records"] == 4 + 3 * r["experts_built"] and "machine" in r
