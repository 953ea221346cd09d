"""jgptq.evaluate on the torch side: a tiny Qwen3-MoE against itself (KL exactly 0, top-1 exactly 1) and against
its compressed-tensors export (KL > 0, equal to a direct float64 computation on llama-perplexity's scored
positions), tokenization with a BOS, and the errors of checkpoints transformers cannot load."""

import importlib.util
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jgptq  # noqa: E402
from jgptq.evaluation import EvaluationError, demo_texts  # noqa: E402

TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"float": a 1-layer tiny Qwen3-MoE folder with a byte tokenizer, "quantized": its RTN 4-bit
    compressed-tensors export}."""
    pytest.importorskip("compressed_tensors")
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    root = tmp_path_factory.mktemp("eval")
    model = tiny_moe(1, 0, **TINY)
    model.save_pretrained(root / "float")
    byte_tokenizer().save_pretrained(root / "float")
    calib = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    result = jgptq.quantize_moe(model, calib, bits=4, group_size=32, scale_dtype="float32", method="rtn",
                                progress=False)
    jgptq.export_model(model, result, "compressed-tensors", root / "quantized")
    return {"float": root / "float", "quantized": root / "quantized"}


def direct(reference, quantized, windows, first):
    """Per-token KL, NLLs and top-1 of two models on int windows (n, n_ctx), torch float64, positions first..-2."""
    ids = torch.from_numpy(windows)
    with torch.no_grad():
        lf = torch.log_softmax(reference(input_ids=ids).logits.double()[:, first:-1], -1)
        lq = torch.log_softmax(quantized(input_ids=ids).logits.double()[:, first:-1], -1)
    target = ids[:, first + 1:, None]
    return {"kl": (lf.exp() * (lf - lq)).sum(-1).reshape(-1).numpy(),
            "nll": -lq.gather(-1, target).reshape(-1).numpy(), "nll_ref": -lf.gather(-1, target).reshape(-1).numpy(),
            "same_top": (lf.argmax(-1) == lq.argmax(-1)).reshape(-1).numpy()}


def test_the_same_model_gives_zero_kl_and_full_agreement(folders):
    got = jgptq.evaluate(folders["float"], folders["float"], n_ctx=64, windows=3, device="cpu")
    s = got.summary
    assert s["tokens"] == 3 * (64 - 1 - 32) and got.windows == 3
    assert s["kl_mean"] == 0.0 and s["kl_max"] == 0.0 and s["same_top_rate"] == 1.0
    assert s["ppl"] == s["ppl_ref"] and got.notes == ()
    assert got.runtimes == {"quantized": "torch on cpu", "reference": "torch on cpu"}


def test_the_quantized_export_against_its_float_model(folders):
    from transformers import AutoModelForCausalLM

    got = jgptq.evaluate(folders["quantized"], folders["float"], n_ctx=64, device="cpu")
    held = np.frombuffer(demo_texts()[1].encode("utf-8"), np.uint8)     # byte tokenizer: token id = byte
    n = held.size // 64
    windows = held[: n * 64].reshape(n, 64).astype(np.int64)
    assert got.windows == n and got.bos_token_id is None and got.text == "jgptq's held-out demo text"
    reference = AutoModelForCausalLM.from_pretrained(folders["float"]).eval()
    quantized = AutoModelForCausalLM.from_pretrained(folders["quantized"]).eval()
    want = direct(reference, quantized, windows, 32)
    assert got.per_token["kl"].shape == (n * 31,)
    np.testing.assert_allclose(got.per_token["kl"], want["kl"], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(got.per_token["nll"], want["nll"], rtol=1e-6)
    np.testing.assert_allclose(got.per_token["nll_ref"], want["nll_ref"], rtol=1e-6)
    assert 0 < got.summary["kl_mean"] < 0.1
    assert got.summary["kl_mean"] == pytest.approx(float(want["kl"].mean()), rel=1e-5)
    # in-memory models and token windows give the same figures
    again = jgptq.evaluate(quantized, reference, tokens=windows)
    np.testing.assert_allclose(again.per_token["kl"], got.per_token["kl"], rtol=1e-6, atol=1e-12)
    assert again.text == "token ids" and again.reference == "Qwen3MoeForCausalLM"


def test_a_tokenizer_that_adds_bos_starts_every_window_with_it():
    from jgptq_torch.cli.evaluate import _token_stream

    class Tokenizer:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=True):
            ids = [10 + b for b in text.encode()]
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    stream, bos = _token_stream(["ab", "c"], Tokenizer(), [])
    assert bos == 1 and stream.tolist() == [1, 10 + 97, 10 + 98, 10 + 10, 10 + 10, 10 + 99]
    with pytest.raises(EvaluationError, match="^text needs a tokenizer: pass tokenizer="):
        _token_stream(["ab"], None, [])


def test_checkpoints_transformers_cannot_load_say_what_to_install(folders, tmp_path):
    if importlib.util.find_spec("optimum") is not None:
        pytest.skip("optimum is installed: transformers may load the GPTQ checkpoint")
    import shutil

    gptq = tmp_path / "gptq"
    shutil.copytree(folders["float"], gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(EvaluationError) as e:
        jgptq.evaluate(gptq, folders["float"], n_ctx=64, windows=1, device="cpu")
    message = str(e.value)
    assert message.startswith(f"transformers could not load the GPTQ checkpoint '{gptq}' (ImportError: ")
    assert message.endswith("); transformers loads GPTQ v1 checkpoints through optimum and gptqmodel (pip install "
                            "optimum gptqmodel); compressed-tensors exports (--export compressed-tensors) need "
                            "neither")


def test_evaluate_is_reachable_without_torch():
    import subprocess
    import sys

    from tests.test_no_torch_import import ROOT

    done = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['torch'] = None\nimport jgptq\n"
                           "print(jgptq.evaluate.__module__, jgptq.Evaluation.__module__)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["jgptq_torch.cli.evaluate", "jgptq.evaluation"]
