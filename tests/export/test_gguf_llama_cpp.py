"""GGUF exports loaded and run by llama.cpp (llama-cpp-python): logits against the torch model.

Tolerances (measured on these tiny models, seed 0, 32 tokens; logit std about 0.32):
- float32 export: llama.cpp and torch compute the same function in float32 (KV cache in f32): max |diff| about
  1e-6, i.e. < 1e-5 of the logit std; asserted < 1e-4.
- GGML weights: llama.cpp's CPU matmuls quantize the activations of every quantized weight (q8_0 blocks of 32
  for q8_0 weights, q8_K blocks of 256 for K formats). Against the plain torch model (same dequantized weights)
  that alone moves logits by 3-5% of their std (up to ~16% where it flips a top-k routing choice in OLMoE and
  Qwen2-MoE, which do not renormalise); asserted < 10% (25% for those two), mean < 2%.
- Against torch with that activation rounding simulated (:func:`act_q8_0`, :func:`act_q8_k`), most positions
  agree to ~1e-6 of the std: the exported blocks are exactly what llama.cpp multiplies. A rounding or routing
  near-tie (a 1e-7 float difference upstream) can flip one decision and move that position, and through
  attention the later ones, by up to a few % (measured: 31/32 positions exact for llama q8_0, 23/32 for
  qwen3_moe q4_k); asserted: position 0 and at least half the positions within 1e-4 of the std.
"""

import functools

import numpy as np
import pytest
import torch

from jgptq_torch.export.gguf.export import export_gguf
from tests.export.gguf_models import quantize_in_place, tiny

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llama_cpp

FAMILIES = ["llama", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]
IDS = [int(x) for x in np.random.default_rng(0).integers(0, 128, 32)]


def llama_cpp_logits(path, ids=IDS) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=2,
                          verbose=False, type_k=0, type_v=0)  # GGML_TYPE_F32 KV cache
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], np.float64)
    finally:
        llm.close()


def act_q8_k(x: torch.Tensor) -> torch.Tensor:
    """Rows of 256 rounded as llama.cpp's q8_K activation blocks: d = -max/127 with max the largest-magnitude
    value, q = min(127, round_half_even(x * -127/max)), value q * d."""
    shape = x.shape
    xb = x.reshape(-1, 256)
    mx = torch.gather(xb, 1, xb.abs().argmax(-1, keepdim=True))
    nz = mx != 0
    iscale = torch.where(nz, -127.0 / torch.where(nz, mx, 1), 0)
    q = torch.clamp(torch.round(iscale * xb), max=127)
    d = torch.where(nz, 1 / torch.where(nz, iscale, 1), 0)
    return (q * d).reshape(shape)


def act_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Rows of 32 rounded as llama.cpp's q8_0 activation blocks (x86 path): d = amax/127 stored as float16,
    q = round_half_even(x * 127/amax), value q * d."""
    shape = x.shape
    xb = x.reshape(-1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    nz = amax > 0
    q = torch.round(xb * torch.where(nz, 127 / torch.where(nz, amax, 1), 0))
    return (q * (amax / 127).half().float()).reshape(shape)


ACTIVATIONS = {"q8_0": act_q8_0, "q4_k": act_q8_k}


def _experts_forward(module, act):
    """A plain per-expert loop that rounds the inputs of gate_up and down with ``act`` (llama.cpp's order)."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        x = act(hidden_states)
        for e in range(module.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if len(tok) == 0:
                continue
            gate, up = (x[tok] @ module.gate_up_proj[e].T).chunk(2, dim=-1)
            h = module.act_fn(gate) * up
            o = act(h) @ module.down_proj[e].T
            out.index_add_(0, tok, o * top_k_weights[tok, slot, None].to(o.dtype))
        return out

    return forward


def torch_logits(model, ids=IDS, act=None) -> np.ndarray:
    """The torch model's logits; with ``act``, the inputs of every quantized matmul are rounded by it."""
    from jgptq_torch import models

    hooks, patched = [], []
    if act is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head" and not name.endswith("shared_expert_gate"):
                hooks.append(mod.register_forward_pre_hook(lambda m, a: (act(a[0]),) + a[1:]))
            elif models.is_experts_module(mod):
                mod.forward = _experts_forward(mod, act)
                patched.append(mod)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()
    finally:
        for h in hooks:
            h.remove()
        for mod in patched:
            del mod.forward


def agreement(got, want):
    diff = np.abs(got - want)
    return float(diff.max()), float(diff.max() / want.std())


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_export_matches_torch(family, tmp_path):
    model = tiny(family)
    path = export_gguf(model, None, tmp_path / "f32.gguf", float_type="f32")
    max_abs, rel = agreement(llama_cpp_logits(path), torch_logits(model))
    print(f"{family} f32: max |diff| {max_abs:.3g}, {rel:.3g} of the logit std")
    assert rel < 1e-4


@functools.lru_cache(maxsize=None)
def _quantized(family, fmt):
    model = tiny(family)
    return model, quantize_in_place(model, fmt)


@pytest.mark.parametrize("family,fmt", [("llama", "q8_0"), ("qwen3_moe", "q8_0"), ("mixtral", "q8_0"),
                                        ("olmoe", "q8_0"), ("qwen2_moe", "q8_0"), ("llama", "q4_k"),
                                        ("qwen3_moe", "q4_k")])
def test_quantized_export_runs_in_llama_cpp(family, fmt, tmp_path):
    model, result = _quantized(family, fmt)
    path = export_gguf(model, result, tmp_path / f"{fmt}.gguf", float_type="f32")
    got = llama_cpp_logits(path)
    plain = torch_logits(model)
    max_abs, rel = agreement(got, plain)
    print(f"{family} {fmt} vs torch: max |diff| {max_abs:.3g}, {rel:.3g} of the logit std, mean |diff| "
          f"{np.mean(np.abs(got - plain)) / plain.std():.3g} of the std")
    # activation rounding only: a few % of the std, more where a routing choice flips (see the module doc)
    assert rel < (0.25 if family in ("olmoe", "qwen2_moe") else 0.1)
    assert np.mean(np.abs(got - plain)) < 0.02 * plain.std()
    sim = torch_logits(model, act=ACTIVATIONS[fmt])
    per_position = np.abs(got - sim).max(axis=1) / plain.std()
    exact = int(np.sum(per_position < 1e-4))
    print(f"{family} {fmt} vs torch with llama.cpp's activation rounding: {exact}/{len(IDS)} positions within "
          f"1e-4 of the std, worst {per_position.max():.3g}, median {np.median(per_position):.3g}")
    assert per_position[0] < 1e-4 and exact >= len(IDS) // 2


@pytest.mark.parametrize("family,fmt,ftype", [("llama", "q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
                                              ("qwen3_moe", "q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
                                              ("qwen3_moe", "q4_k", "LLAMA_FTYPE_MOSTLY_Q4_K_M")])
def test_llama_quantize_of_the_float_export_gives_the_same_bytes(family, fmt, ftype, tmp_path):
    """llama.cpp's own quantizer, run on the f32 export (``pure``, embeddings and output kept f32), writes the very
    tensors of the quantized export: same names, shapes, types and bytes (the float export is a faithful
    quantizer input; the quantized export holds what llama.cpp would have made of it without GPTQ)."""
    import ctypes

    import gguf

    f32 = export_gguf(tiny(family), None, tmp_path / "f32.gguf", float_type="f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(llama_cpp, ftype)
    params.pure = True
    params.output_tensor_type = params.token_embedding_type = int(gguf.GGMLQuantizationType.F32)
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    model, result = _quantized(family, fmt)
    ours = export_gguf(model, result, tmp_path / "ours.gguf", float_type="f32")
    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert list(a[name].shape) == list(b[name].shape), name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}], ids=["llama3", "linear"])
def test_rope_scaling(rope, tmp_path):
    """Scaled rotary embeddings (llama3's rope_freqs tensor, linear's scaling factor) match torch; the scaling
    matters here (logits move by ~15% of their std without it)."""
    from tests.tiny_models import build

    model = build("llama", hidden_size=256, head_dim=64, rope_parameters=rope)
    got = llama_cpp_logits(export_gguf(model, None, tmp_path / "r.gguf", float_type="f32"))
    _, rel = agreement(got, torch_logits(model))
    _, unscaled = agreement(got, torch_logits(build("llama", hidden_size=256, head_dim=64)))
    assert rel < 1e-4 and unscaled > 0.05
