"""QuantizedWeight from real solver results: exact dequantization, validation, per-expert naming."""

import numpy as np
import pytest

from jgptq.export import QuantizedWeight, expert_entries
from tests.export.conftest import GROUP, config, solved, solved_experts


@pytest.mark.parametrize("cfg", [config(), config(bits=3, sym=False, act_order="desc"),
                                 config(bits=2, group_size=-1, sym=False), config(act_order="group_aware")],
                         ids=["4sym", "3asym-desc", "2asym-channel", "4sym-gar"])
def test_dequantize_is_the_solved_weight(cfg):
    result, rec = solved(cfg)
    assert np.array_equal(rec.dequantize(), np.asarray(result.weight))
    assert rec.codes.dtype == np.uint8 and rec.zeros.dtype == np.uint8 and rec.g_idx.dtype == np.int32
    assert rec.has_plain_g_idx() == (cfg.act_order != "desc")
    assert not rec.codes.flags.writeable


def test_dequantize_against_float64_gather():
    _, rec = solved(config(bits=3, sym=False, act_order="desc"))
    want = np.empty(rec.shape)
    for c in range(rec.shape[1]):
        g = rec.g_idx[c]
        want[:, c] = rec.scales[:, g].astype(np.float64) * (rec.codes[:, c].astype(np.float64) - rec.zeros[:, g])
    assert np.array_equal(rec.dequantize(), want.astype(np.float32))


def test_expert_stack_and_names():
    result, stack = solved_experts(config())
    assert stack.shape == (7, 64, 64)
    assert np.array_equal(stack.dequantize(), np.asarray(result.weight))
    names = ["model.layers.2.mlp.experts.{expert}.gate_proj", "model.layers.2.mlp.experts.{expert}.up_proj"]
    entries = dict(expert_entries(stack, names, start=4))
    assert list(entries) == [n.format(expert=e) for e in range(4, 11) for n in names]
    gate, up = entries["model.layers.2.mlp.experts.5.gate_proj"], entries["model.layers.2.mlp.experts.5.up_proj"]
    assert gate.shape == up.shape == (32, 64)
    assert np.array_equal(np.concatenate([gate.dequantize(), up.dequantize()]), np.asarray(result.weight)[1])
    single = dict(expert_entries(stack, "x.{expert}.down_proj"))
    assert np.array_equal(single["x.6.down_proj"].dequantize(), np.asarray(result.weight)[6])
    with pytest.raises(ValueError, match="expert"):
        list(expert_entries(stack, "x.down_proj"))
    with pytest.raises(ValueError, match="split evenly"):
        list(expert_entries(stack, ["a.{expert}", "b.{expert}", "c.{expert}"]))


def test_ggml_results_are_refused():
    from jgptq import QuantConfig

    class R:
        codes = None

    with pytest.raises(ValueError, match="GGUF"):
        QuantizedWeight.from_result(R(), QuantConfig())


def _fields(rec, **changes):
    base = dict(codes=rec.codes, scales=rec.scales, zeros=rec.zeros, g_idx=rec.g_idx, bits=rec.bits,
                group_size=rec.group_size, sym=rec.sym, act_order=rec.act_order, scale_dtype=rec.scale_dtype)
    base.update(changes)
    return base


@pytest.mark.parametrize("change, rule", [
    (lambda r: dict(bits=9), "bits"),
    (lambda r: dict(codes=r.codes.astype(np.int32) + 16), "codes: values must lie in"),
    (lambda r: dict(scales=-r.scales), "positive"),
    (lambda r: dict(scales=r.scales[:, :2]), "scales: shape"),
    (lambda r: dict(g_idx=r.g_idx + 3), "g_idx: values"),
    (lambda r: dict(g_idx=r.g_idx[:-1]), "g_idx: shape"),
    (lambda r: dict(zeros=r.zeros.astype(np.float32) + 0.5), "integers"),
    (lambda r: dict(zeros=np.zeros_like(r.zeros)), "symmetric"),
    (lambda r: dict(scales=r.scales * np.float32(1 + 2**-15)), "representable"),
    (lambda r: dict(group_size=0), "group_size"),
    (lambda r: dict(act_order="random"), "act_order"),
])
def test_validation(change, rule):
    _, rec = solved(config())
    with pytest.raises(ValueError, match=rule):
        QuantizedWeight(**_fields(rec, **change(rec)))
    assert GROUP == rec.group_size


def test_take_gives_views_of_a_checked_stack():
    result, stack = solved_experts(config())
    rows = np.array([5, 0, 17, 3])
    part = stack.take(2, rows, method="rtn")
    full = np.asarray(result.weight)
    assert np.array_equal(part.dequantize(), full[2][rows]) and part.method == "rtn" and stack.method == "gptq"
    half = stack.take(4, slice(32, 64))
    assert np.shares_memory(half.codes, stack.codes)          # a slice is a view: no copy per expert
    assert np.array_equal(half.dequantize(), full[4, 32:])
    assert not half.codes.flags.writeable and not part.codes.flags.writeable
    with pytest.raises(ValueError, match="method: 'cached' is not one of"):
        stack.take(0, method="cached")
    with pytest.raises(IndexError, match="no leading axis"):
        stack[0].take(0)


def test_a_record_does_not_copy_codes_of_its_dtype_and_leaves_them_writeable_for_their_owner():
    result, rec = solved(config())
    codes = np.array(rec.codes)
    mine = QuantizedWeight(codes, rec.scales, rec.zeros, rec.g_idx, bits=rec.bits, group_size=rec.group_size,
                           sym=rec.sym)
    assert np.shares_memory(mine.codes, codes) and codes.flags.writeable and not mine.codes.flags.writeable
