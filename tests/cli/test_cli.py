"""The jgptq command line: bad input (in-process), quantize + export, kill -9 and resume to the same bytes, and
the demo (subprocesses)."""

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from jgptq_torch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
CALIB = ROOT / "jgptq" / "data" / "calibration.txt"
TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)
KILL_AFTER = """
import os, signal, sys
from jgptq_torch.pipeline import resume
original = resume.Checkpoint.save_layer
def save_layer(self, i, *args):
    original(self, i, *args)
    if i == {layer}:
        os.kill(os.getpid(), signal.SIGKILL)
resume.Checkpoint.save_layer = save_layer
from jgptq_torch.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny 3-layer Qwen3-MoE with random weights and a byte-level tokenizer, saved as transformers saves it."""
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    d = tmp_path_factory.mktemp("model")
    tiny_moe(3, 0, **TINY).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")   # compiled programs shared by the subprocesses
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
                JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def cli(env, *args, script=None, timeout=300):
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "-m", "jgptq_torch"]
    return subprocess.run(cmd + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def quantize_args(model_dir, out, *extra):
    return ["quantize", model_dir, "--calib", CALIB, "--out", out, "--samples", 16, "--seq-len", 64,
            "--group-size", 32, "--quiet", *extra]


def tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_version_help_and_no_torch_at_import(env):
    from jgptq import __version__

    assert cli(env, "--version").stdout.strip() == f"jgptq {__version__}"
    out = cli(env, "quantize", "--help").stdout
    assert all(opt in out for opt in ("--resume, --no-resume", "--calibration", "--act-order", "--export"))
    probe = ("import sys, jgptq_torch.cli.main; jgptq_torch.cli.main.build_parser(); "
             "print(sorted(m for m in ('torch', 'jax', 'transformers') if m in sys.modules))")
    assert cli(env, script=probe).stdout.strip() == "[]"


@pytest.mark.parametrize("extra, message", [
    (["--format", "q4_k", "--export", "gptq"], "GGML block format"),
    (["--bits", "5", "--export", "gptq"], "GPTQ v1 loaders read bits"),
    (["--act-order", "desc"], "act_order 'desc'"),
    (["--bits", "9"], "QuantConfig.bits=9"),
])
def test_formats_the_exporter_cannot_hold(model_dir, tmp_path, capsys, extra, message):
    assert main([str(a) for a in quantize_args(model_dir, tmp_path / "out", *extra)]) == 1
    assert message in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_bad_inputs_get_clear_errors_and_nothing_is_written(model_dir, tmp_path, capsys):
    from jgptq_torch.export.checkpoint import gguf_available

    def fails(args, message):
        before = tree(tmp_path)
        assert main([str(a) for a in args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("jgptq: error: ") and message in err, err
        assert tree(tmp_path) == before

    out = tmp_path / "out"
    fails(quantize_args(tmp_path / "nowhere", out), "does not exist")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    fails(quantize_args(tmp_path / "bin", out), "holds no .safetensors weights")
    if not gguf_available():
        fails(quantize_args(model_dir, out, "--export", "gguf"), "jgptq_torch.export.gguf.export")
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier work")
    fails(quantize_args(model_dir, out), "already exists; pass --overwrite")
    (tmp_path / "empty.txt").write_text("  \n")
    fails(quantize_args(model_dir, tmp_path / "o2")[:2] + ["--calib", tmp_path / "empty.txt", "--out",
                                                          tmp_path / "o2"], "is empty")
    fails(["quantize", model_dir, "--calib", tmp_path / "bin", "--out", tmp_path / "o3"], "holds no .txt files")
    fails(["quantize", model_dir, "--calib", tmp_path / "missing.txt", "--out", tmp_path / "o4"], "does not exist")
    assert not any(p.name.endswith((".jgptq-work", ".report.json")) for p in tmp_path.iterdir())


@pytest.mark.slow     # about a minute on 2 cores: three runs of the command
def test_quantize_exports_and_a_killed_run_resumes_to_the_same_bytes(model_dir, env, tmp_path):
    transformers = pytest.importorskip("transformers")
    whole = tmp_path / "whole"
    done = cli(env, *quantize_args(model_dir, whole))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "expert coverage" in done.stdout and "wrote" in done.stdout
    files = tree(whole)
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    assert not (tmp_path / "whole.jgptq-work").exists()
    report = json.loads((tmp_path / "whole.report.json").read_text())
    assert len(report["records"]) == 3 * (4 + 16)
    ET.parse(tmp_path / "whole.loss.svg")
    config = transformers.AutoConfig.from_pretrained(whole)
    assert config.quantization_config["config_groups"]["group_0"]["weights"]["num_bits"] == 4

    killed = tmp_path / "killed"
    run = cli(env, *quantize_args(model_dir, killed), script=KILL_AFTER.format(layer=1))
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    work = tmp_path / "killed.jgptq-work"
    assert json.loads((work / "state.json").read_text())["layers_done"] == 2 and not killed.exists()
    again = cli(env, *quantize_args(model_dir, killed)[:-1])     # with progress messages
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the run" in again.stderr and "2 layers done" in again.stderr
    assert tree(killed) == files                                   # every file, byte for byte
    resumed = json.loads((tmp_path / "killed.report.json").read_text())
    assert resumed["records"] == report["records"]
    assert not work.exists()


@pytest.mark.slow     # about 40 s on 2 cores: the whole demo
def test_demo_runs_offline_and_gptq_beats_round_to_nearest(env, tmp_path):
    out = tmp_path / "demo" / "m"
    run = cli(env, "demo", "--out", out, "--layers", 2, "--samples", 16, "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    ratio = float(run.stdout.split("GPTQ / RTN = ")[1].split()[0])
    assert 0 < ratio < 1, run.stdout
    assert "logits equal the quantized model's" in run.stdout or "reload check: skipped" in run.stdout
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    svg = ET.parse(out.with_name("m.loss.svg")).getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and all(len(p.get("points").split()) == 2 for p in lines)


def test_ggml_options_make_the_pipeline_config(monkeypatch):
    from jgptq_torch.cli import command
    from jgptq_torch.export import checkpoint as export
    from jgptq_torch.cli.main import build_parser

    def parsed(*extra):
        return build_parser().parse_args(["quantize", "m", "--calib", "c", "--out", "o", *extra])

    monkeypatch.setattr(export, "gguf_available", lambda: True)
    cfg = command.build_config(parsed("--export", "gguf", "--mix", "q4_k_m", "--tensor-format", r"v_proj$=q8_0",
                                      "--tensor-format", "experts=iq4_xs", "--importance", "hessian",
                                      "--block-fallback", "llama.cpp", "--method", "rtn"), "float32")
    assert cfg.quant.format == "q4_k" and cfg.mix == "q4_k_m" and cfg.method == "rtn"
    assert cfg.formats == ((r"v_proj$", "q8_0"), ("experts", "iq4_xs"))
    assert cfg.importance == "hessian" and cfg.block_fallback == "llama.cpp"
    assert cfg.imatrix_source == "replay"
    assert command.build_config(parsed("--export", "gguf", "--format", "q4_k", "--imatrix-source", "float"),
                                "float32").imatrix_source == "float"
    with pytest.raises(command.CommandError, match="REGEX=FORMAT"):
        command.build_config(parsed("--export", "gguf", "--format", "q4_k", "--tensor-format", "v_proj"), "float32")
    with pytest.raises(ValueError, match="needs importance"):
        command.build_config(parsed("--export", "gguf", "--format", "iq2_xxs", "--importance", "none"), "float32")
    for kind in ("gptq", "compressed-tensors"):   # a mix is GGML: the integer exporters refuse it up front
        with pytest.raises(export.ExportError, match="GGML block format"):
            command.build_config(parsed("--export", kind, "--mix", "q4_k_m"), "float32")


def test_act_order_router_weighting_and_method_options_make_the_pipeline_config(monkeypatch):
    from jgptq_torch.cli import command
    from jgptq_torch.cli.main import build_parser
    from jgptq_torch.export import checkpoint as export

    def config(*extra):
        args = build_parser().parse_args(["quantize", "m", "--calib", "c", "--out", "o", *extra])
        return command.build_config(args, "float32")

    monkeypatch.setattr(export, "gguf_available", lambda: True)
    assert config().quant.act_order == "static" and config().moe.router_weighting == "none"
    assert config("--export", "gguf", "--format", "q4_k").quant.act_order == "none"
    assert config("--act-order", "none").quant.act_order == "none"
    assert config("--router-weighting", "squared").moe.router_weighting == "squared"
    assert config("--method", "gptq_search_diag").method == "gptq_search_diag"   # methods built into jgptq
    assert config("--method", "awq").method == "awq"
    with pytest.raises(SystemExit):
        config("--method", "smoothquant")
    with pytest.raises(ValueError, match="MoEConfig.router_weighting"):
        config("--router-weighting", "linear", "--calibration", "all_experts")


def test_option_defaults_are_the_config_defaults():
    from jgptq_torch.cli import command
    from jgptq_torch.cli.main import build_parser
    from jgptq.config import PipelineConfig

    args = build_parser().parse_args(["quantize", "m", "--calib", "c", "--out", "o"])
    # no option given: the library's defaults, but for the window length the command line tokenizes to
    assert command.build_config(args, "float16") == PipelineConfig.build(None, max_length=args.seq_len)
    demo = build_parser().parse_args(["demo"])
    assert demo.bits == PipelineConfig().quant.bits


@pytest.mark.slow     # about 30 s on 2 cores
def test_quantize_to_gguf_writes_the_blocks_the_run_chose(model_dir, env, tmp_path):
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    out = tmp_path / "m.gguf"
    done = cli(env, *quantize_args(model_dir, out, "--format", "q8_0", "--export", "gguf", "--tensor-format",
                                   r"down_proj$=q4_0"))
    assert done.returncode == 0, done.stderr[-3000:]
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down_exps.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"    # llama.cpp's types for a Q8_0 file
    assert bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert bytes(reader.fields["general.name"].parts[-1]).decode() == Path(model_dir).name  # the model's folder
    # the expert blocks decode to float weights of the right shape and the non-expert tensors are unchanged
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    values = gguf.quants.dequantize(down.data, down.tensor_type)
    assert values.shape == (8, TINY["hidden_size"], TINY["moe_intermediate_size"]) and np.isfinite(values).all()
    source = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    norm = next(t for t in reader.tensors if t.name == "blk.2.attn_norm.weight")
    np.testing.assert_array_equal(np.asarray(norm.data), source["model.layers.2.input_layernorm.weight"])


def test_progress_in_a_log_file_is_one_line_per_layer(model_dir, env, tmp_path):
    import re

    args = [a for a in quantize_args(model_dir, tmp_path / "out", "--format", "q8_0", "--export", "gguf")
            if a != "--quiet"]
    log = tmp_path / "stderr.log"
    with log.open("w") as err:   # a file, not a terminal
        done = subprocess.run([sys.executable, "-m", "jgptq_torch", *map(str, args)], env=env, stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=300, cwd=ROOT)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text, repr(text[-2000:])
    # a stage slow enough (on a slow or loaded machine) gets its own line: progress_in_a_log_names_only_the_slow_stages
    quick = [line for line in text.splitlines() if not re.search(r" took \d+\.\d s, \w+ next$", line)]
    assert not [line for line in quick if "calibrate" in line or "replay" in line], text[-3000:]
    layer_lines = [line for line in quick if line.startswith("jgptq layers")]
    times = [re.sub(r"about \d+ s left", "about N s left", re.sub(r"in \d+\.\d s", "in T s", line))
             for line in layer_lines]
    assert times == ["jgptq layers: 1/3 (layer 0 in T s, about N s left)",
                     "jgptq layers: 2/3 (layer 1 in T s, about N s left)", "jgptq layers: 3/3 (layer 2 in T s)"]


def test_progress_in_a_log_names_only_the_slow_stages(monkeypatch):
    import io

    from jgptq_torch import progress as progress_mod

    clock = iter([0.0,            # the loop begins
                  0.0, 1.0, 31.0,  # layer 0 begins; "calibrate" at 1 s; "solve" at 31 s (calibrate took 30 s)
                  33.0, 40.0,      # "replay" at 33 s (solve took 2 s: no line); layer 0 ends at 40 s
                  40.0, 41.0, 42.0])  # layer 1 begins; "calibrate" at 41 s (the earlier stage is layer 0's: none)
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    layers = progress_mod.LayerProgress(0, 2, eta=True)
    for i in layers:
        for name in ("calibrate", "solve", "replay") if i == 0 else ("calibrate",):
            layers.stage(name)
    assert log.getvalue().splitlines() == [
        "jgptq layers: layer 0 calibrate took 30.0 s, solve next",
        "jgptq layers: 1/2 (layer 0 in 40.0 s, about 40 s left)",
        "jgptq layers: 2/2 (layer 1 in 2.0 s)"]


def test_progress_on_a_terminal_names_the_stage(monkeypatch):
    import io

    from jgptq_torch.progress import LayerProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    progress = LayerProgress(1, 3)
    for i in progress:
        progress.stage("solve")
    text = screen.getvalue()
    assert "layer 1 solve" in text and "layer 2 solve" in text and "3/3" in text
    assert "jgptq layers: 2/3 (layer" not in text   # the bar, not log lines


def test_gptq_names_modules_reaches_the_exporter(model_dir, tmp_path, monkeypatch):
    from jgptq_torch.export import checkpoint as export

    calls = []
    original = export.module_keys

    def recording(model, result):
        calls.append(type(model).__name__)
        return original(model, result)

    monkeypatch.setattr(export, "module_keys", recording)
    out = tmp_path / "m"
    args = quantize_args(model_dir, out, "--export", "gptq", "--gptq-names", "modules", "--method", "rtn")
    assert main([str(a) for a in args]) == 0
    assert calls == ["Qwen3MoeForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.3.up_proj.qweight" in index     # Qwen3-MoE: module and checkpoint names agree
