"""The command line refuses bad options before it loads anything: the model folder here holds a config.json and a
safetensors file that is not one, so any attempt to load the tokenizer or the model would fail differently."""

import pytest

from jgptq_torch.cli.main import main


@pytest.fixture
def unloadable(tmp_path, monkeypatch):
    """A model folder that passes the folder checks but cannot be loaded; loading raises AssertionError."""
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("the model or tokenizer was loaded before the options were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_moe", "dtype": "float32"}')
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "calib.txt").write_text("some calibration text\n")
    return tmp_path


def refused(folder, capsys, *extra):
    """The one-line error of ``jgptq quantize`` with ``extra`` options; asserts that nothing was written."""
    before = sorted(p.name for p in folder.iterdir())
    args = ["quantize", folder / "model", "--calib", folder / "calib.txt", "--out", folder / "out.gguf", *extra]
    assert main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jgptq: error: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in folder.iterdir()) == before
    return err.strip()


def test_gguf_export_without_a_ggml_format_is_refused_up_front(unloadable, capsys):
    assert refused(unloadable, capsys, "--export", "gguf") == (
        "jgptq: error: GGUF export needs a GGML format, not 'int' (integer grids): pass --format q4_k (or another "
        "GGML format) or --mix q4_k_m (format=/mix= in Python); integer grids export as 'gptq' or "
        "'compressed-tensors'")
    assert refused(unloadable, capsys, "--export", "gguf", "--method", "rtn").startswith(
        "jgptq: error: GGUF export needs a GGML format, not 'int'")


def test_gptq_names_on_another_export_is_refused_up_front(unloadable, capsys):
    assert refused(unloadable, capsys, "--gptq-names", "modules") == (
        "jgptq: error: --gptq-names modules is for --export gptq (GPTQModel.load); compressed-tensors checkpoints "
        "keep the names their loaders read")


def test_export_format_rule_is_one_function_the_library_shares():
    from jgptq_torch.export.checkpoint import ExportError, check_format
    from jgptq.config import QuantConfig

    with pytest.raises(ExportError, match=r"^GGUF export needs a GGML format, not 'int'"):
        check_format("gguf", QuantConfig())
    check_format("gguf", QuantConfig(format="q4_k"))
    with pytest.raises(ExportError, match="is a GGML block format"):
        check_format("gptq", QuantConfig(format="q4_k"))


def test_options_are_checked_before_the_model_is_loaded(unloadable, capsys):
    import json

    config = unloadable / "model" / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "dtype": "float32", "hidden_size": 2048}))
    assert refused(unloadable, capsys, "--group-size", "100") == (
        "jgptq: error: --group-size 100 does not divide the model's hidden_size 2048 (config.json), the input "
        "width of its attention and expert projections; use --group-size 128")
    assert refused(unloadable, capsys, "--group-size", "0") == (
        "jgptq: error: QuantConfig.group_size=0: must be -1 (per channel) or a positive integer")
    assert refused(unloadable, capsys, "--samples", "0") == (
        "jgptq: error: --samples 0: the number of calibration sequences must be at least 1 (default: 128)")
    assert refused(unloadable, capsys, "--seq-len", "1") == (
        "jgptq: error: --seq-len 1: calibration windows need at least 16 tokens (default: 512)")
    assert refused(unloadable, capsys, "--batch-size", "0") == (
        "jgptq: error: PipelineConfig.batch_size=0: must be a positive integer")
    config.write_text(json.dumps({"model_type": "qwen3_moe", "text_config": {"hidden_size": 96}}))
    assert refused(unloadable, capsys, "--group-size", "64").endswith(
        "hidden_size 96 (config.json), the input width of its attention and expert projections; use --group-size 32")


@pytest.mark.parametrize("where", ["before", "after"])
def test_traceback_is_accepted_before_or_after_the_subcommand(unloadable, where):
    from jgptq_torch.export.checkpoint import ExportError
    from jgptq_torch.cli.main import build_parser

    args = ["quantize", unloadable / "model", "--calib", unloadable / "calib.txt", "--out", unloadable / "o.gguf",
            "--export", "gguf"]
    args = ["--traceback", *args] if where == "before" else [*args, "--traceback"]
    with pytest.raises(ExportError, match=r"^GGUF export needs a GGML format, not 'int'"):
        main([str(a) for a in args])
    assert build_parser().parse_args(["demo", "--traceback"]).traceback is True
    assert build_parser().parse_args(["--traceback", "demo"]).traceback is True
    assert build_parser().parse_args(["demo"]).traceback is False


@pytest.mark.parametrize("command", [[], ["quantize"]])
def test_help_lists_the_registered_ggml_formats_and_the_mixes(command, capsys):
    from jgptq.ggml import format_names, get_format
    from jgptq.mixes import PRESETS

    with pytest.raises(SystemExit) as stop:
        main([*command, "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())   # help text wraps lines
    formats = [n for n in format_names() if get_format(n).encode is not None]
    assert "q4_k" in formats and "iq2_xxs" in formats
    assert f"GGML formats (--format, --tensor-format; for --export gguf): {', '.join(formats)} " in text
    mixes = ", ".join(f"{mix} (on {base})" for mix, base in PRESETS.items())
    assert f"llama.cpp mixes (--mix; for --export gguf): {mixes}" in text


def test_resume_refusal_names_the_settings_that_differ(tmp_path):
    from types import SimpleNamespace

    import torch

    from jgptq_torch.pipeline import resume
    from jgptq.config import PipelineConfig
    from tests.tiny_models import build

    model = build("qwen3_moe", num_hidden_layers=1)
    batches = [SimpleNamespace(input_ids=torch.arange(8)[None], attention_mask=torch.ones(1, 8, dtype=torch.long))]

    def state_of(cfg):
        return resume.fingerprint(model, batches, cfg, 1)

    first = resume.Checkpoint(tmp_path, state_of(PipelineConfig.build(None)))
    assert first.open() == 0
    first.save_layer(0, {}, {}, None)
    again = PipelineConfig.build(None, progress=False, offload="cpu")   # where and how visibly: not a setting
    assert resume.Checkpoint(tmp_path, state_of(again)).open() == 1
    changed = PipelineConfig.build(None, format="q4_k", group_size=32, mix="q4_k_m")
    with pytest.raises(resume.ResumeMismatchError) as refusal:
        resume.Checkpoint(tmp_path, state_of(changed)).open()
    assert str(refusal.value) == (
        f"{tmp_path} holds the state of another run (the quantization settings (mix None then, 'q4_k_m' now; "
        f"quant.act_order 'static' then, 'none' now; quant.format 'int' then, 'q4_k' now; quant.group_size 128 "
        f"then, 32 now) differ, after 1 finished "
        f"layers); refusing to mix them. Start over with resume=False (command line: --no-resume), or use another "
        f"output folder")


def test_each_warning_is_shown_once(tmp_path, capsys):
    import json

    from tests.cli.test_cli import CALIB
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    model = tmp_path / "model"
    tiny_moe(2, 0, hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    out = tmp_path / "out"
    args = ["quantize", model, "--calib", CALIB, "--out", out, "--samples", 8, "--seq-len", 32, "--group-size", 32,
            "--quiet", "--min-tokens", 100]     # every expert sees fewer tokens: a warning per experts weight
    assert main([str(a) for a in args]) == 0
    captured = capsys.readouterr()
    said = json.loads(out.with_name("out.report.json").read_text())["warnings"]
    assert len(said) == 4 and said[0].startswith(
        "experts [0, 1, 2, 3, 4, 5, 6, 7] of model.layers.0.mlp.experts.down_proj: fewer than 100 calibration "
        "tokens (")
    lines = captured.err.splitlines()
    assert all(lines.count(f"jgptq: warning: {w}") == 1 for w in said), captured.err
    assert [line for line in lines if "warning" in line.lower()] == [f"jgptq: warning: {w}" for w in said]
    assert not [line for line in captured.out.splitlines() if line.startswith("warning:")]


def test_demo_refuses_gguf_export_while_parsing(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--export", "gguf"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]     # how choices are quoted depends on the Python version
    assert last.startswith("jgptq demo: error: argument --export: invalid choice: 'gguf' (choose from ")
    assert last.count("gguf") == 1 and "compressed-tensors" in last and "gptq" in last
