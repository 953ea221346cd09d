"""jgptq.evaluate with GGUF files in llama.cpp: an F32 export of a tiny Qwen3-MoE against itself (KL exactly 0),
a llama.cpp Q4_0 file against it (llama-perplexity's definition: the per-token figures of the scored second halves
equal a direct float64 computation from llama.cpp's logits), the GGUF's own tokenizer, and the note when the float
logits come from torch."""

import ctypes

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.llama_cpp

import jgptq  # noqa: E402
from jgptq_torch.cli import llama_logits  # noqa: E402
from jgptq_torch.cli.evaluate import MIXED_RUNTIMES  # noqa: E402
from tests.test_evaluation import direct_kl  # noqa: E402

TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)
TEXT = "A held-out paragraph, long enough for a few windows of sixty-four bytes each, read by llama.cpp. " * 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The float folder (byte tokenizer), its F32 GGUF with the vocabulary, and llama.cpp's Q4_0 of that GGUF."""
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    root = tmp_path_factory.mktemp("evalgguf")
    model, tok = tiny_moe(1, 0, **TINY), byte_tokenizer()
    model.save_pretrained(root / "float")
    tok.save_pretrained(root / "float")
    f32, q4 = root / "float-f32.gguf", root / "q4_0.gguf"
    jgptq.export_gguf(model, None, f32, tokenizer=tok, float_type="f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype, params.pure = 1, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), ctypes.byref(params)) == 0
    return {"float": root / "float", "f32": f32, "q4": q4}


def test_the_same_gguf_gives_zero_kl_with_its_own_tokenizer(files):
    got = jgptq.evaluate(files["f32"], files["f32"], TEXT, n_ctx=64, threads=1)
    data = np.frombuffer(TEXT.encode(), np.uint8)
    assert got.windows == data.size // 64 and got.bos_token_id is None
    assert got.summary["tokens"] == got.windows * 31
    assert got.summary["kl_max"] == 0.0 and got.summary["same_top_rate"] == 1.0
    assert got.runtimes == {"quantized": "llama.cpp", "reference": "llama.cpp"} and got.notes == ()
    stream, bos = llama_logits.tokenize(str(files["f32"]), TEXT)
    np.testing.assert_array_equal(stream, data)           # the byte vocabulary: one token per byte, no BOS
    assert bos is None


def test_the_scored_positions_are_llama_perplexity_s(files):
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 256, (3, 32))
    got = jgptq.evaluate(files["q4"], files["f32"], tokens=windows, threads=1)
    ref = llama_logits.logits(str(files["f32"]), windows, threads=1)
    quant = llama_logits.logits(str(files["q4"]), windows, threads=1)
    first = 16                                             # n_ctx // 2: positions 16..30 predict tokens 17..31
    want = [direct_kl(ref[i, p], quant[i, p]) for i in range(3) for p in range(first, 31)]
    np.testing.assert_allclose(got.per_token["kl"], want, rtol=1e-9, atol=1e-15)
    nll = [np.log(np.exp(quant[i, p].astype(np.float64)).sum()) - quant[i, p, windows[i, p + 1]]
           for i in range(3) for p in range(first, 31)]
    np.testing.assert_allclose(got.per_token["nll"], nll, rtol=1e-9)
    assert got.summary["kl_mean"] > 0 and got.summary["tokens"] == 3 * 15


def test_a_torch_reference_is_named_in_the_notes(files):
    got = jgptq.evaluate(files["f32"], files["float"], TEXT, n_ctx=64, threads=1, device="cpu")
    assert got.runtimes == {"quantized": "llama.cpp", "reference": "torch on cpu"}
    assert got.notes == (MIXED_RUNTIMES.format(ref="torch on cpu", quant="llama.cpp"),)
    assert got.notes[0] == (
        "the float logits come from torch on cpu and the quantized ones from llama.cpp, so the KL includes the two "
        "runtimes' own difference; for a like-for-like comparison give an F32 GGUF of the float model "
        "(jgptq.export_gguf(model, None, 'f32.gguf', float_type='f32')) as the float model")
    assert got.summary["kl_max"] < 1e-6                    # the same float model in both runtimes
