"""Which loader reads which export, checked with the loaders' own code on quantize_moe results of tiny models.

The README's table of loaders rests on these tests. The transformers GPTQ path needs optimum and gptqmodel, the
GPTQModel one gptqmodel (its first load on a CPU compiles a kernel extension for minutes); both skip without them.
"""

import warnings

import pytest
import torch

import jgptq
from jgptq_torch.export.checkpoint import export_model
from tests.tiny_models import build, next_token_kl, token_ids

transformers = pytest.importorskip("transformers")
CALIB = token_ids(8, 32, seed=1)
IDS = token_ids(2, 16, seed=5)
# group 32: GPTQModel's float32 CPU kernel takes groups of 32, 64, 128 or 256 only
OPTS = dict(bits=4, group_size=32, batch_size=8, progress=False)
_RUNS: dict = {}

QWEN3_GPTQ = ("Qwen3MoeForCausalLM keeps its experts fused (model.layers.0.mlp.experts.down_proj): transformers' "
              "GPTQ loader reads only nn.Linear modules and would leave these experts randomly initialized, without "
              "an error. This GPTQ v1 checkpoint loads with GPTQModel.load and vLLM; for transformers, export "
              "'compressed-tensors' with symmetric grids")
MIXTRAL_GPTQ = ("MixtralForCausalLM keeps its experts fused (model.layers.0.mlp.experts.down_proj): transformers' "
                "GPTQ loader reads only nn.Linear modules and would leave these experts randomly initialized, without "
                "an error. This GPTQ v1 checkpoint loads with vLLM (GPTQModel.load 7.7 refuses it: it looks the "
                "experts up as model.layers.0.mlp.experts.0.down_proj, not as "
                "model.layers.0.block_sparse_moe.experts.0.w2; export with names='modules' for it); for "
                "transformers, export 'compressed-tensors' with symmetric grids")
MIXTRAL_GPTQ_MODULES = (
    "MixtralForCausalLM keeps its experts fused (model.layers.0.mlp.experts.down_proj): transformers' GPTQ loader "
    "reads only nn.Linear modules and would leave these experts randomly initialized, without an error. This GPTQ "
    "v1 checkpoint loads with GPTQModel.load (it holds the experts under module names, "
    "model.layers.0.mlp.experts.0.down_proj; vLLM reads this family under its checkpoint names, "
    "names='checkpoint', model.layers.0.block_sparse_moe.experts.0.w2); for transformers, export "
    "'compressed-tensors' with symmetric grids")
ASYM_CT = ("asymmetric grids: transformers loads this compressed-tensors checkpoint only with "
           "quantization_config=CompressedTensorsConfig(dequantize=True) (without it, loading fails on the packed "
           "zero points){}; symmetric grids (sym=True) load either way")


def run(family, **opts):
    """(float model, quantized model, result), cached per module."""
    key = (family, tuple(sorted(opts.items())))
    if key not in _RUNS:
        model = build(family)
        _RUNS[key] = (build(family), model, jgptq.quantize_moe(model, CALIB, **{**OPTS, **opts}))
    return _RUNS[key]


def export(family, kind, out, names="checkpoint", **opts):
    """Exports a run; returns (float model, quantized model, the warnings' texts)."""
    from jgptq_torch.cli.demo import byte_tokenizer

    reference, model, result = run(family, **opts)
    tokenizer = byte_tokenizer()          # GPTQModel.load reads a tokenizer and wants pad and eos tokens
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens([0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_model(model, result, kind, out, tokenizer=tokenizer, names=names)
    return reference, model, [str(w.message) for w in caught if w.category is UserWarning]


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family, expected", [("qwen3_moe", [QWEN3_GPTQ]), ("mixtral", [MIXTRAL_GPTQ]),
                                              ("llama", [])])
def test_gptq_export_of_fused_experts_warns_once_naming_the_loaders(tmp_path, family, expected):
    assert export(family, "gptq", tmp_path / "m", method="rtn")[2] == expected


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "llama"])
def test_transformers_loads_symmetric_compressed_tensors_with_the_solved_weights(tmp_path, family):
    pytest.importorskip("compressed_tensors")
    _, model, messages = export(family, "compressed-tensors", tmp_path / "m", scale_dtype="float32")
    assert messages == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert torch.equal(logits(loaded), logits(model))
    mine, theirs = model.state_dict(), loaded.state_dict()     # decompressed by the first forward
    assert set(mine) <= set(theirs)
    for k in mine:   # experts fused back from the per-expert tensors, every weight the solver's
        assert torch.equal(mine[k], theirs[k]), k


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_asymmetric_compressed_tensors_warns_and_transformers_loads_it_dense_and_dequantized_only(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    opts = dict(scale_dtype="float32", sym=False, method="rtn")
    assert export("qwen3_moe", "compressed-tensors", tmp_path / "moe", **opts)[2] == [
        ASYM_CT.format(", and fails on the fused experts' zero points even with it")]
    _, model, messages = export("llama", "compressed-tensors", tmp_path / "dense", **opts)
    assert messages == [ASYM_CT.format("")]
    dequantized = CompressedTensorsConfig(dequantize=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32,
                                                               quantization_config=dequantized).eval()
    assert torch.equal(logits(loaded), logits(model))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):     # the packed zero points' shape
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32,
                                                          quantization_config=dequantized)


def _kl_budget(reference, model):
    """A loader holds the solved weights when its KL to them is far below the quantization's own KL."""
    return 0.01 * next_token_kl(reference, model, IDS)


def test_transformers_gptq_loader_reads_dense_models_and_not_fused_experts(tmp_path):
    pytest.importorskip("optimum")
    pytest.importorskip("gptqmodel")
    for family, holds_the_weights in (("llama", True), ("qwen3_moe", False)):
        reference, model, _ = export(family, "gptq", tmp_path / family)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32).eval()
        experts = [n for n, p in loaded.named_parameters() if p.ndim == 3]
        assert bool(experts) is not holds_the_weights      # fused experts stay plain float parameters
        kl = next_token_kl(model, loaded, IDS)
        assert (kl < _kl_budget(reference, model)) is holds_the_weights, (family, kl)


def test_mixtral_gptq_export_under_module_names_warns_for_vllm_and_names_the_experts_per_module(tmp_path):
    from safetensors import safe_open

    assert export("mixtral", "gptq", tmp_path / "m", names="modules", method="rtn")[2] == [MIXTRAL_GPTQ_MODULES]
    keys = set()
    for f in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(f, "np") as st:
            keys.update(st.keys())
    assert {"model.layers.0.mlp.experts.3.gate_proj.qweight", "model.layers.0.mlp.experts.3.up_proj.qweight",
            "model.layers.0.mlp.experts.3.down_proj.qweight", "model.layers.0.mlp.gate.weight"} <= keys
    assert not any("block_sparse_moe" in k or ".w1." in k for k in keys)


def test_module_names_are_refused_for_other_exports(tmp_path):
    from jgptq_torch.export.checkpoint import ExportError

    with pytest.raises(ExportError, match="names='modules' is for 'gptq' exports"):
        export("mixtral", "compressed-tensors", tmp_path / "m", names="modules", method="rtn")


def test_gptqmodel_load_reads_qwen3_moe_dense_and_mixtral_under_module_names(tmp_path):
    gptqmodel = pytest.importorskip("gptqmodel")
    # every export first: GPTQModel.load patches transformers' MoE classes for the rest of the process
    runs = {family: export(family, "gptq", tmp_path / family)[:2] for family in ("llama", "qwen3_moe", "mixtral")}
    runs["mixtral_modules"] = export("mixtral", "gptq", tmp_path / "mixtral_modules", names="modules")[:2]
    for family in ("llama", "qwen3_moe", "mixtral_modules"):
        reference, model = runs[family]
        loaded = gptqmodel.GPTQModel.load(str(tmp_path / family), device="cpu", dtype=torch.float32)
        kl = next_token_kl(model, loaded.model.eval(), IDS)
        assert kl < _kl_budget(reference, model), (family, kl)
    with pytest.raises(ValueError, match="Missing required quantized weights.*experts.0.down_proj.qweight"):
        gptqmodel.GPTQModel.load(str(tmp_path / "mixtral"), device="cpu", dtype=torch.float32)


def test_demo_does_not_reload_gptq_with_transformers(tmp_path):
    from jgptq_torch.cli.demo import _reload_check

    assert _reload_check(tmp_path, "gptq", None, None) == (
        "reload check: skipped (transformers' GPTQ loader would leave this MoE model's fused experts random; "
        "GPTQModel.load reads the checkpoint)")
