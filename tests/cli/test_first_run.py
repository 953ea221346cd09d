"""A new user's first run: what would fail late or obscurely is refused before the model loads, with a message that
says what is wrong and what to do (device, GGUF routing, tokenizer files, a broken config.json)."""

import json
import shutil

import pytest

from jgptq_torch.cli.main import main
from tests.cli.test_cli import CALIB, TINY


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A tiny 2-layer Qwen3-MoE folder with the demo's byte tokenizer; loading the model fails the test."""
    import transformers

    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    tiny_moe(2, 0, **TINY).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    return tmp_path


def error_of(folder, capsys, *extra, model="model"):
    args = ["quantize", folder / model, "--calib", CALIB, "--out", folder / "out", "--quiet", "--group-size", 32,
            *extra]
    assert main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jgptq: error: ") and err.count("\n") == 1, err
    return err.strip()


def test_cuda_on_a_machine_without_one_is_refused_up_front(folder, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert error_of(folder, capsys, "--device", "cuda") == (
        f"jgptq: error: --device cuda: torch sees no CUDA device on this machine (torch {torch.__version__}, CUDA "
        f"none (a CPU-only build)); leave --device out or pass --device cpu to run on the CPU, or install a CUDA build "
        f"of torch where there is a GPU")
    assert error_of(folder, capsys, "--device", "gpu0").startswith("jgptq: error: --device gpu0: not a torch device")


def test_gguf_routing_llama_cpp_cannot_compute_is_refused_from_config_json(folder, capsys):
    cfg_path = folder / "model" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, norm_topk_prob=False)))
    assert error_of(folder, capsys, "--export", "gguf", "--format", "q8_0") == (
        f"jgptq: error: {cfg_path}: Qwen3MoeForCausalLM: norm_topk_prob=False: llama.cpp's qwen3moe graph always "
        f"uses norm_topk_prob=True; the GGUF would route differently. A model trained with norm_topk_prob=False runs "
        f"faithfully from a compressed-tensors or gptq checkpoint (transformers and vLLM read the setting); if its "
        f"config.json is wrong, set norm_topk_prob to true there")


def test_an_architecture_without_a_gguf_exporter_is_refused_from_config_json(folder, capsys):
    cfg_path = folder / "model" / "config.json"
    cfg_path.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
                                    "n_layer": 1, "n_head": 4, "vocab_size": 256}))
    got = error_of(folder, capsys, "--export", "gguf", "--format", "q8_0")
    assert got.startswith(f"jgptq: error: {cfg_path}: GPT2LMHeadModel (model_type 'gpt2') has no GGUF exporter; "
                          f"supported model types: ["), got


def test_missing_tokenizer_files_are_named(folder, capsys):
    for name in ("tokenizer.json",):
        (folder / "model" / name).unlink()
    assert error_of(folder, capsys) == (
        f"jgptq: error: no tokenizer files in {str(folder / 'model')!r} (it has tokenizer_config.json): a tokenizer "
        f"needs one of tokenizer.json, tokenizer.model, spiece.model, sentencepiece.bpe.model, vocab.json + "
        f"merges.txt, vocab.txt, tiktoken.model; copy them from the model's source, or pass --tokenizer DIR")
    other = folder / "tok"
    other.mkdir()
    assert error_of(folder, capsys, "--tokenizer", other).endswith("tiktoken.model; pass a folder that has them")
    shutil.copy(folder / "model" / "tokenizer_config.json", other)


def test_a_truncated_config_json_is_named_with_where_it_breaks(folder, capsys):
    cfg_path = folder / "model" / "config.json"
    text = cfg_path.read_text()
    start = text.index('"model_type"')   # the file ends inside this string
    cut = start + 5
    cfg_path.write_text(text[:cut])
    assert error_of(folder, capsys) == (
        f"jgptq: error: {cfg_path} is not valid JSON: Unterminated string starting at line "
        f"{text[:start].count(chr(10)) + 1}, column {start - text.rfind(chr(10), 0, start)} (character {start} of "
        f"{cut} bytes) (the file ends before the JSON does: it looks truncated); restore it from the model's source")


def run_of(folder, capsys, *extra, out="out"):
    args = ["quantize", folder / "model", "--calib", CALIB, "--out", folder / out, "--group-size", 32, *extra]
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_a_second_run_on_the_same_output_is_refused_naming_the_lock_and_the_process(folder, capsys):
    import socket
    import subprocess
    import sys

    lock = folder / "out.jgptq-lock"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"pid": running.pid, "host": socket.gethostname(), "started": "2026-01-02 03:04:05"}))
        code, err = run_of(folder, capsys, "--quiet")
    finally:
        running.kill()
        running.wait()
    assert code == 1 and err == (
        f"jgptq: error: another jgptq run is writing {str(folder / 'out')!r}: process {running.pid} on "
        f"{socket.gethostname()}, started 2026-01-02 03:04:05 holds the lock {lock}; wait for it to finish, or choose "
        f"another --out (if no such run exists, remove the lock file)\n")
    assert lock.exists()                                   # the other run's lock is left alone


def test_a_stale_lock_is_taken_over_and_released_and_killed_exports_leftovers_removed(folder, capsys):
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock = folder / "out.gguf.jgptq-lock"
    lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "2026-01-02 03:04:05"}))
    (folder / ".out.gguf.k2j4h1.tmp").write_bytes(b"\0" * 1000)      # a GGUF file being written when killed
    (folder / ".out.gguf.header.x8f").write_bytes(b"\0" * 24)
    (folder / ".out.gguf.notes").write_text("not ours")
    code, err = run_of(folder, capsys, "--export", "gguf", "--format", "q8_0", "--device", "gpu0", out="out.gguf")
    lines = err.splitlines()
    assert code == 1 and lines[-1].startswith("jgptq: error: --device gpu0: not a torch device")
    assert f"jgptq: taking over the lock {lock} of process {gone.pid}, which is gone" in lines
    assert (f"jgptq: removed what a killed run left: {folder / '.out.gguf.header.x8f'}, "
            f"{folder / '.out.gguf.k2j4h1.tmp'} (1,024 bytes)") in lines
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".out") or "lock" in p.name) == [
        ".out.gguf.notes"]                                 # the lock released at the end, the stranger kept


def test_an_architecture_without_linear_layers_is_named_as_such():
    import torch
    import transformers

    import jgptq

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                                                n_positions=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError) as err:
        jgptq.quantize_moe(gpt2.eval(), torch.arange(32)[None], progress=False)
    assert str(err.value) == (
        "GPT2LMHeadModel: this architecture has no torch.nn.Linear or transformers experts weights in its decoder "
        "layers (transformer.h) (its matrices are in Conv1D modules); jgptq quantizes those only, so there is "
        "nothing to quantize")


def test_a_resume_refused_for_changed_settings_never_says_it_is_continuing(tmp_path, capsys):
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    tiny_moe(2, 0, **TINY).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    work = tmp_path / "out.jgptq-work"
    work.mkdir()
    (work / "state.json").write_text(json.dumps({"version": 0, "fingerprint": {}, "layers_done": 1}))
    code, err = run_of(tmp_path, capsys, "--samples", 2, "--seq-len", 32)
    assert code == 1 and "continuing" not in err, err
    assert err.splitlines()[-1].startswith(f"jgptq: error: {work} holds the state of another run ("), err


def test_an_output_folder_that_cannot_be_written_is_refused_before_loading(folder, capsys, monkeypatch):
    import errno
    import os

    real = os.open

    def read_only(path, *args, **kwargs):   # the folder of --out on a read-only file system (root ignores modes)
        if str(path).startswith(str(folder / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    (folder / "ro").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    args = ["quantize", folder / "model", "--calib", CALIB, "--out", folder / "ro" / "out", "--quiet"]
    assert main([str(a) for a in args]) == 1
    assert capsys.readouterr().err == (
        f"jgptq: error: --out {str(folder / 'ro' / 'out')!r}: cannot write in {str(folder / 'ro')!r} (Read-only file "
        f"system); choose an --out in a writable folder\n")


def test_eval_of_a_gptq_folder_without_its_loader_is_refused_before_the_float_model_runs(tmp_path, capsys,
                                                                                        monkeypatch):
    from transformers import utils

    from jgptq_torch.cli import evaluate

    quantized = tmp_path / "q"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "gptq", "bits": 4}}))
    monkeypatch.setattr(utils, "is_optimum_available", lambda: False)
    monkeypatch.setattr(utils, "is_gptqmodel_available", lambda: True)
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("the evaluation started"))
    assert main(["eval", str(quantized), "--float", str(tmp_path / "float"), "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"jgptq: error: {str(quantized)!r} is a GPTQ v1 checkpoint, which transformers loads through optimum and "
        f"gptqmodel; optimum is not installed here (pip install optimum); compressed-tensors exports (--export "
        f"compressed-tensors) need neither\n")
