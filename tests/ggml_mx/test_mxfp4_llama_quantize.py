"""A whole MXFP4_MOE model against llama.cpp (skipped without llama-cpp-python): llama_model_quantize with its own
MXFP4_MOE rules, run on jgptq's float export, writes exactly the tensors (names, types, shapes, bytes) of jgptq's
export of the same model encoded by jgptq (experts MXFP4, other weights Q8_0, edges kept float), and llama.cpp
runs that export."""

import ctypes
import types

import numpy as np
import pytest
import torch

from jgptq.export.records import GGMLWeight
from jgptq.ggml import encode, get_format
from jgptq_torch.export.gguf.export import export_gguf
from tests.export.gguf_models import is_target, tiny

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llama_cpp


def _encode_mxfp4_moe(model):
    """Experts stacks (3-D parameters) in MXFP4, every other target weight in Q8_0: llama.cpp's shape rule."""
    weights = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_target(name, p):
                continue
            fmt = "mxfp4" if p.ndim == 3 else "q8_0"
            f = get_format(fmt)
            w = p.detach().float().numpy()
            payload = np.asarray(encode(w, fmt)).reshape(w.shape[:-1] + (w.shape[-1] // f.block_size, f.type_size))
            rec = GGMLWeight(payload, fmt, method="rtn")
            p.copy_(torch.from_numpy(np.array(rec.dequantize())))
            weights[name] = rec
    return types.SimpleNamespace(weights=weights, param_keys={name: [name] for name in weights})


def test_llama_quantize_mxfp4_moe_writes_jgptqs_bytes(tmp_path):
    import gguf

    f32 = export_gguf(tiny("qwen3_moe"), None, tmp_path / "f32.gguf", float_type="f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    params.output_tensor_type = params.token_embedding_type = int(gguf.GGMLQuantizationType.F32)
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    model = tiny("qwen3_moe")
    result = _encode_mxfp4_moe(model)
    ours = export_gguf(model, result, tmp_path / "ours.gguf", float_type="f32", float_embeddings=True)
    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    assert set(a) == set(b)
    kinds = set()
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert list(a[name].shape) == list(b[name].shape), name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name
        kinds.add(a[name].tensor_type.name)
    assert {"MXFP4", "Q8_0"} <= kinds

    llm = llama_cpp.Llama(model_path=str(ours), logits_all=True, n_ctx=32, n_batch=32, n_threads=2, verbose=False)
    try:
        ids = [int(i) for i in np.random.default_rng(0).integers(0, 128, 16)]
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)], np.float64)
    finally:
        llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double().numpy()
    print(f"mxfp4_moe export in llama.cpp vs torch: max |diff| {np.abs(got - want).max() / want.std():.3g} of the "
          f"logit std over {len(a)} tensors ({sorted(kinds)})")
    # llama.cpp rounds the activations of MXFP4 and Q8_0 matmuls to q8_0 blocks: a few % of the logit std
    assert np.isfinite(got).all() and np.abs(got - want).max() < 0.1 * want.std()
