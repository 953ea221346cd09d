"""compressed-tensors pack-quantized checkpoints, decoded by the compressed-tensors package itself."""

import json

import numpy as np
import pytest

from jgptq.export import export_compressed_tensors
from jgptq.export.records import storage_dtype
from tests.export.conftest import COLS, GRIDS, ROWS, config, solved
from tests.export.test_gptq_v1 import MODEL_CONFIG, read_checkpoint

torch = pytest.importorskip("torch")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

NAME = "model.layers.0.self_attn.q_proj"
F32_MODEL = dict(MODEL_CONFIG, dtype="float32")


def scheme_of(out):
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    return parsed.config_groups["group_0"]


def module_state(tensors, name, upcast=False):
    state = {k[len(name) + 1:]: torch.from_numpy(v.astype(np.float32) if upcast and k.endswith("weight_scale")
                                                 else v)
             for k, v in tensors.items() if k.startswith(name + ".")}
    return state


def package_decompress(tensors, name, scheme, upcast=False):
    return PackedQuantizationCompressor.decompress(module_state(tensors, name, upcast), scheme)["weight"]


@pytest.mark.parametrize("bits, sym, group_size", GRIDS)
def test_round_trip_through_the_package(tmp_path, bits, sym, group_size):
    cfg = config(bits=bits, sym=sym, group_size=group_size)
    result, rec = solved(cfg)
    export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG, quant_config=cfg)
    t = read_checkpoint(tmp_path / "m")
    expect = {"weight_packed", "weight_scale", "weight_shape"} | (set() if sym else {"weight_zero_point"})
    assert {k[len(NAME) + 1:] for k in t} == expect
    g = 1 if group_size == -1 else COLS // group_size
    assert t[f"{NAME}.weight_packed"].shape == (ROWS, -(-COLS * bits // 32))
    assert t[f"{NAME}.weight_scale"].shape == (ROWS, g) and t[f"{NAME}.weight_scale"].dtype == np.float16
    assert t[f"{NAME}.weight_shape"].dtype == np.int64 and t[f"{NAME}.weight_shape"].tolist() == [ROWS, COLS]
    if not sym:
        assert t[f"{NAME}.weight_zero_point"].shape == (-(-ROWS * bits // 32), g)
    scheme = scheme_of(tmp_path / "m")
    assert scheme.weights.num_bits == bits and scheme.weights.symmetric == sym
    assert scheme.weights.strategy == ("channel" if group_size == -1 else "group")
    # float16 arithmetic in the stored dtype, and float32 arithmetic on the losslessly widened scales
    native = package_decompress(t, NAME, scheme)
    assert native.dtype == torch.float16
    assert np.array_equal(native.numpy(), np.asarray(result.weight).astype(np.float16))
    wide = package_decompress(t, NAME, scheme, upcast=True)
    assert np.array_equal(wide.numpy(), np.asarray(result.weight))


@pytest.mark.parametrize("act_order", ["static", "group_aware"])
def test_monotonic_act_orders_say_weight(tmp_path, act_order):
    cfg = config(bits=4, sym=False, act_order=act_order)
    result, rec = solved(cfg)
    qc = export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG, quant_config=cfg)
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    scheme = scheme_of(tmp_path / "m")
    assert scheme.weights.actorder == "weight"
    t = read_checkpoint(tmp_path / "m")
    assert not any(k.endswith("g_idx") for k in t)
    assert np.array_equal(package_decompress(t, NAME, scheme, upcast=True).numpy(), np.asarray(result.weight))


def test_bfloat16_and_float32_scales(tmp_path):
    for dtype in ("bfloat16", "float32"):
        cfg = config(bits=4, sym=False, scale_dtype=dtype)
        result, rec = solved(cfg)
        export_compressed_tensors(tmp_path / dtype, {NAME: rec}, model_config=dict(MODEL_CONFIG, dtype=dtype))
        t = read_checkpoint(tmp_path / dtype)
        assert t[f"{NAME}.weight_scale"].dtype == storage_dtype(dtype)
        got = package_decompress(t, NAME, scheme_of(tmp_path / dtype), upcast=True)
        assert np.array_equal(got.numpy(), np.asarray(result.weight))
    # float32 scales cannot be stored as bfloat16 without changing the weights
    with pytest.raises(ValueError, match="not exactly representable in bfloat16"):
        export_compressed_tensors(tmp_path / "x", {NAME: rec}, model_config=MODEL_CONFIG, scale_dtype="bfloat16")
    assert not (tmp_path / "x").exists()


def test_model_dtype_mismatch_warns(tmp_path):
    rec = solved(config())[1]
    with pytest.warns(UserWarning, match="model dtype is bfloat16"):
        export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=dict(MODEL_CONFIG, dtype="bfloat16"))


def test_desc_groups_refused_unless_legacy_layout(tmp_path):
    cfg = config(bits=3, sym=False, act_order="desc")
    result, rec = solved(cfg)
    with pytest.raises(ValueError, match="group_actorder=True"):
        export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG)
    assert not (tmp_path / "m").exists()

    qc = export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG, group_actorder=True)
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    with pytest.raises(ValueError, match="removed"):  # this package version no longer reads the layout
        QuantizationConfig.model_validate(qc)
    legacy = json.loads(json.dumps(qc))
    legacy["config_groups"]["group_0"]["weights"]["actorder"] = None
    scheme = QuantizationConfig.model_validate(legacy).config_groups["group_0"]
    t = read_checkpoint(tmp_path / "m")
    g_idx = torch.from_numpy(t[f"{NAME}.weight_g_idx"]).long()
    assert np.array_equal(g_idx.numpy(), np.asarray(result.g_idx))
    codes = unpack_from_int32(torch.from_numpy(t[f"{NAME}.weight_packed"]), 3, torch.Size([ROWS, COLS]))
    zp = unpack_from_int32(torch.from_numpy(t[f"{NAME}.weight_zero_point"]), 3, torch.Size([ROWS, 3]),
                           packed_dim=0)
    scale = torch.from_numpy(t[f"{NAME}.weight_scale"].astype(np.float32))
    # g_idx semantics: column c uses group g_idx[c]; the package's own arithmetic with one group per column
    per_column = QuantizationArgs(num_bits=3, symmetric=False, strategy="group", group_size=1)
    w = dequantize(codes, scale[:, g_idx], zp[:, g_idx], args=per_column)
    assert np.array_equal(w.numpy(), np.asarray(result.weight))
    assert scheme.weights.num_bits == 3


def test_config_parses_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = config(bits=4, act_order="group_aware")
    rec = solved(cfg)[1]
    export_compressed_tensors(tmp_path / "m", {NAME: rec}, model_config=MODEL_CONFIG, quant_config=cfg,
                              ignore=["lm_head", "re:.*mlp.gate$"])
    auto = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    parsed = CompressedTensorsConfig.from_dict(auto.quantization_config)
    inner = parsed.quantization_config
    assert inner.format == "pack-quantized" and inner.ignore == ["lm_head", "re:.*mlp.gate$"]
    weights = inner.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.symmetric, weights.actorder) == (4, 32, True, "weight")


def test_refusals_write_nothing(tmp_path):
    rec = solved(config())[1]
    with pytest.raises(ValueError, match="listed in ignore"):
        export_compressed_tensors(tmp_path / "m", {"lm_head": rec}, model_config=MODEL_CONFIG)
    with pytest.raises(ValueError, match="listed in ignore"):
        export_compressed_tensors(tmp_path / "m", {"model.layers.0.mlp.gate": rec}, model_config=MODEL_CONFIG,
                                  ignore=["re:.*mlp.gate$"])
    with pytest.raises(ValueError, match="one quantization scheme"):
        export_compressed_tensors(tmp_path / "m", {"a": rec, "b": solved(config(bits=8))[1]},
                                  model_config=MODEL_CONFIG)
    with pytest.raises(ValueError, match="scale_dtype"):
        export_compressed_tensors(tmp_path / "m", {"a": rec}, model_config=MODEL_CONFIG, scale_dtype="fp8")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export_compressed_tensors(tmp_path / "m", {"a": rec}, model_config=MODEL_CONFIG)
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["x"]
