"""Bad input refused before the model is loaded, with messages that name the problem: calibration that is not text
or too short, safetensors files that are truncated or garbled; and the demo's temporary folder removed."""

import json
import struct
import warnings

import numpy as np
import pytest

from jgptq_torch.cli.main import main
from tests.cli.test_early_checks import refused, unloadable  # noqa: F401 - the fixture is used by name

TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)


@pytest.fixture
def byte_model(tmp_path, monkeypatch):
    """A tiny 2-layer Qwen3-MoE folder with the demo's byte tokenizer (one token per byte of ASCII text)."""
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    model = tmp_path / "model"
    tiny_moe(2, 0, **TINY).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    return tmp_path


def no_model_load(monkeypatch):
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the calibration was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)


def quantize(folder, capsys, *extra):
    """Exit status and stderr of ``jgptq quantize`` on ``folder/model`` with ``folder/calib.txt``."""
    args = ["quantize", folder / "model", "--calib", folder / "calib.txt", "--out", folder / "out", "--quiet",
            "--group-size", 32, *extra]
    status = main([str(a) for a in args])
    return status, capsys.readouterr().err


# -- calibration text ------------------------------------------------------------------------------------------
def test_bytes_that_are_not_utf8_are_refused_naming_the_file_and_the_offset(unloadable, capsys):  # noqa: F811
    calib = unloadable / "calib.txt"
    calib.write_bytes(b"plain text, then " + b"\xe9t\xe9 in Latin-1")
    assert refused(unloadable, capsys) == (
        f"jgptq: error: calibration file {str(calib)!r} is not UTF-8 text: invalid continuation byte at byte offset "
        f"17 (0xe9); convert it to UTF-8 (e.g. iconv -t UTF-8) or pass another file")
    calib.write_bytes("text saved as UTF-16".encode("utf-16"))
    assert refused(unloadable, capsys) == (
        f"jgptq: error: calibration file {str(calib)!r} is not UTF-8 text (it starts with a UTF-16 byte-order mark): "
        f"invalid start byte at byte offset 0 (0xff); convert it to UTF-8 (e.g. iconv -t UTF-8) or pass another file")
    noise = np.random.default_rng(0).bytes(200_000)
    calib.write_bytes(noise)
    first_bad = next(i for i in range(len(noise)) if noise[i] >= 0x80)   # ASCII bytes are UTF-8; 0x80.. start
    assert noise[first_bad] < 0xC2 or noise[first_bad] > 0xF4                  # no sequence here (see below)
    assert refused(unloadable, capsys) == (
        f"jgptq: error: calibration file {str(calib)!r} is not UTF-8 text: invalid start byte at byte offset "
        f"{first_bad} (0x{noise[first_bad]:02x}); convert it to UTF-8 (e.g. iconv -t UTF-8) or pass another file")


def test_text_that_is_mostly_control_characters_is_refused(unloadable, capsys):  # noqa: F811
    calib = unloadable / "calib.txt"
    calib.write_bytes("hello world".encode("utf-16-le"))   # valid UTF-8, every other character a NUL
    assert refused(unloadable, capsys) == (
        f"jgptq: error: calibration file {str(calib)!r} is not text: 11 of its 22 characters are control characters "
        f"(the first, '\\x00', at character 1); calibrate on plain text")
    calib.write_text("text with a tab\there, a bell \x07 and lines\n" * 20)  # a few controls are still text:
    assert refused(unloadable, capsys).startswith(                               # the next check speaks
        f"jgptq: error: {unloadable / 'model' / 'model.safetensors'} is not a readable safetensors file")


def test_too_few_tokens_are_refused_or_warned_about_by_the_window_rule(byte_model, capsys, monkeypatch):
    from jgptq_torch.pipeline.calib import window_shortfall

    no_model_load(monkeypatch)
    calib = byte_model / "calib.txt"
    calib.write_text("x" * 26)   # the byte tokenizer: one token per ASCII byte
    assert quantize(byte_model, capsys) == (1, (
        f"jgptq: error: calibration {str(calib)!r} gives 26 tokens, not one window of --seq-len 512 (128 x 512 = "
        f"65,536 tokens were asked for); give more text, or a smaller --seq-len\n"))
    calib.write_text("x" * 6000)   # 11 windows: 5,632 tokens, under a tenth of 65,536
    assert quantize(byte_model, capsys) == (1, (
        f"jgptq: error: calibration {str(calib)!r} gives 6,000 tokens, 11 windows of 512: under a tenth of the "
        f"65,536 tokens asked for (--samples 128 x --seq-len 512); give more text, or pass --samples 11 to "
        f"calibrate on what it holds\n"))
    with pytest.raises(ValueError, match="12 windows of 512: under a tenth"):   # 6,144 of 65,536 tokens used
        window_shortfall(6655, 512, 128, "c")
    assert window_shortfall(65536, 512, 128, "c") is None and window_shortfall(10**6, 512, 128, "c") is None
    assert window_shortfall(6656, 512, 128, "c") == (   # 13 windows = 6,656 tokens: a tenth or more
        "calibration 'c' gives 6,656 tokens, 13 windows of 512: fewer than the 128 asked for (--samples 128 x "
        "--seq-len 512 = 65,536 tokens); calibrating on 13 windows (6,656 tokens)")


def test_fewer_windows_than_asked_is_one_warning_and_the_run_goes_on(byte_model, capsys):
    calib = byte_model / "calib.txt"
    calib.write_text("some calibration text. " * 30 + "ab")   # 692 bytes: 10 windows of 64, 16 asked for
    status, err = quantize(byte_model, capsys, "--samples", 16, "--seq-len", 64)
    assert status == 0, err
    warning = (f"calibration {str(calib)!r} gives 692 tokens, 10 windows of 64: fewer than the 16 asked for "
               f"(--samples 16 x --seq-len 64 = 1,024 tokens); calibrating on 10 windows (640 tokens)")
    assert err.splitlines().count(f"jgptq: warning: {warning}") == 1
    report = json.loads((byte_model / "out.report.json").read_text())
    assert report["warnings"][0] == warning and report["calibration_tokens"] == 640


def test_the_library_refuses_control_character_text_and_warns_under_the_width_floor():
    import jgptq
    from tests.tiny_models import build, token_ids

    class Tok:
        pad_token_id = 0

        def __call__(self, text, **kw):
            return {"input_ids": [ord(c) % 100 for c in text]}

    llama = build("llama")
    with pytest.raises(ValueError) as refusal:
        jgptq.quantize_moe(llama, ["fine text", "\x01\x02\x03 binary"], tokenizer=Tok(), group_size=16,
                           progress=False)
    assert str(refusal.value) == ("calibration text 1 is not text: 3 of its 10 characters are control characters "
                                  "(the first, '\\x01', at character 0); calibrate on plain text")
    # 2 x 32 tokens against the 128 input columns of the MLP's down_proj (the widest weight of the tiny llama)
    with pytest.warns(UserWarning) as said:
        result = jgptq.quantize_moe(llama, token_ids(2, 32, seed=1), method="rtn", bits=4, group_size=16,
                                    progress=False)
    floor = ("calibration holds 64 tokens, fewer than the 128 input columns of model.layers.0.mlp.down_proj: "
             "Hessians that wide are rank-deficient and GPTQ leans on damping there; give at least 128 tokens "
             "(several times more is better)")
    assert [str(w.message) for w in said].count(floor) == 1 and result.report.warnings.count(floor) == 1
    with warnings.catch_warnings(record=True) as said:   # 4 x 32 = 128 tokens, as many as columns: no warning
        warnings.simplefilter("always")
        result = jgptq.quantize_moe(build("llama"), token_ids(4, 32, seed=1), method="rtn", bits=4, group_size=16,
                                    progress=False)
    assert not [w for w in said if "input columns" in str(w.message)]
    assert not [w for w in result.report.warnings if "input columns" in w]


# -- safetensors files -----------------------------------------------------------------------------------------
def shard(path, n=6):
    from safetensors.numpy import save_file

    save_file({"a": np.arange(n, dtype=np.float32), "b": np.ones((2, 2), np.float16)}, str(path))
    return path.read_bytes()


def header_of(raw: bytes) -> tuple:
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length])


def test_safetensors_headers_are_checked_and_problems_named(tmp_path):
    from jgptq_torch.pipeline.weight_checks import CorruptWeightsError, check_safetensors_files

    f = tmp_path / "model.safetensors"
    raw = shard(f)
    check_safetensors_files(tmp_path)
    length, table = header_of(raw)
    data = len(raw) - 8 - length
    advice = "; copy or save it again (an interrupted download or copy leaves such files)"

    def problem():
        with pytest.raises(CorruptWeightsError) as refusal:
            check_safetensors_files(tmp_path)
        return str(refusal.value)

    f.write_bytes(raw[:-5])
    last = max(table.items(), key=lambda kv: kv[1]["data_offsets"][1] if kv[0] != "__metadata__" else -1)
    assert problem() == (f"{f} is not a readable safetensors file: tensor {last[0]!r} ends at byte {data:,} of the "
                         f"data, but the file holds {data - 5:,} bytes of data (5 missing): the file is truncated"
                         + advice)
    f.write_bytes(raw[:5])
    assert problem() == (f"{f} is not a readable safetensors file: it is 5 bytes long, too short for the 8-byte "
                         f"header length a safetensors file starts with" + advice)
    f.write_bytes(raw[:8 + length - 1])
    assert problem() == (f"{f} is not a readable safetensors file: its header length {length:,} runs past the end "
                         f"of the file ({8 + length - 1:,} bytes): the file is truncated or not a safetensors file"
                         + advice)
    f.write_bytes(raw[:8] + b"#" + raw[9:])
    assert problem().startswith(f"{f} is not a readable safetensors file: its {length:,}-byte header is not JSON (")
    table["a"]["shape"] = [7]
    body = json.dumps(table).encode().ljust(length)
    f.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length:])
    begin, end = table["a"]["data_offsets"]
    assert problem() == (f"{f} is not a readable safetensors file: tensor 'a' (F32, shape [7]) needs 28 bytes but "
                         f"its data_offsets [{begin}, {end}] hold 24" + advice)
    shard(f)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "c": "model-00002-of-00002.safetensors"}}))
    assert problem() == (f"{tmp_path / 'model.safetensors.index.json'} names 1 shard(s) missing from {tmp_path}: "
                         f"model-00002-of-00002.safetensors" + advice)


def test_a_corrupt_shard_is_refused_before_loading(unloadable, capsys):  # noqa: F811
    f = unloadable / "model" / "model.safetensors"     # holds b"not a safetensors file"
    length = int.from_bytes(b"not a sa", "little")
    assert refused(unloadable, capsys) == (
        f"jgptq: error: {f} is not a readable safetensors file: its header length {length:,} runs past the end of "
        f"the file (22 bytes): the file is truncated or not a safetensors file; copy or save it again (an "
        f"interrupted download or copy leaves such files)")


# -- the demo's folder -----------------------------------------------------------------------------------------
def test_demo_without_out_removes_its_temporary_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    from jgptq_torch.pipeline import layerwise

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert main(["demo", "--layers", "1", "--samples", "4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert list(scratch.iterdir()) == []
    assert ("checkpoint: compressed-tensors, " in out and " MB, written to a temporary folder and removed with its "
            "report and chart (pass --out DIR to keep them)" in out)
    assert str(scratch) not in out

    def fail(*args, **kwargs):
        raise ValueError("stopped")

    monkeypatch.setattr(layerwise, "quantize_moe", fail)   # a failed run cleans up too
    assert main(["demo", "--layers", "1", "--samples", "4", "--quiet"]) == 1
    assert capsys.readouterr().err == "jgptq: error: stopped\n"
    assert list(scratch.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(ValueError, match="stopped"):   # with --out the folder is the user's: left in place
        main(["demo", "--out", str(kept), "--layers", "1", "--traceback"])
    assert kept.is_dir()
