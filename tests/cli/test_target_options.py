"""--target-bpw / --target-size / --target-formats on the command line: parsed into the config, and refused with
exact messages before anything is loaded."""

import argparse

import pytest

from jgptq_torch.cli.command import build_config, size_to_bpw
from jgptq_torch.cli.main import build_parser
from tests.cli.test_cli import cli, env, model_dir, quantize_args  # noqa: F401 - fixtures
from tests.cli.test_early_checks import refused, unloadable  # noqa: F401 - the fixture

ARGS = ["quantize", "m", "--calib", "c.txt", "--out", "o.gguf"]


def config_of(*extra) -> object:
    args = build_parser().parse_args(ARGS + list(extra))
    return build_config(args, "float32")


def test_target_options_become_config_fields():
    cfg = config_of("--export", "gguf", "--target-bpw", "2.5", "--target-formats", "IQ2_XXS, q4_k,q8_0")
    assert cfg.target_bpw == 2.5 and cfg.target_formats == ("iq2_xxs", "q4_k", "q8_0")
    assert cfg.quant.format == "q4_k" and cfg.target_gain == "fisher"     # a GGUF target is a GGML run
    cfg = config_of("--export", "gguf", "--target-size", "1GB", "--target-gain", "one", "--format", "q8_0")
    assert cfg.quant.format == "q8_0" and cfg.target_bpw == 16.0 and cfg.target_gain == "one"   # placeholder
    assert config_of("--export", "gguf", "--format", "q8_0").target_bpw is None


def test_a_target_size_is_bits_per_weight_over_the_decoder_layers():
    from tests.tiny_models import build

    model = build("qwen3_moe")
    # per layer: q (64x64), k, v (32x64), o (64x64), 8 experts of gate_up (64x64) and down (64x32)
    weights = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 8 * (64 * 64 + 64 * 32))
    assert size_to_bpw(model, "61440") == pytest.approx(61440 * 8 / weights)
    assert size_to_bpw(model, "60KiB") == pytest.approx(60 * 1024 * 8 / weights)


@pytest.mark.parametrize("extra, message", [
    (("--target-bpw", "2.5", "--target-size", "1GB"),
     "jgptq: error: --target-bpw and --target-size both set the budget; give one of them"),
    (("--target-formats", "q4_k",),
     "jgptq: error: --target-formats needs a budget: --target-bpw BITS or --target-size SIZE"),
    (("--export", "gguf", "--target-bpw", "2.5", "--mix", "q4_k_m"),
     "jgptq: error: --target-bpw chooses every tensor's format and cannot be combined with --mix q4_k_m; fix some "
     "tensors with --tensor-format REGEX=FORMAT instead"),
    (("--export", "gguf", "--target-size", "24GB", "--mix", "q4_k_m"),
     "jgptq: error: --target-size chooses every tensor's format and cannot be combined with --mix q4_k_m; fix some "
     "tensors with --tensor-format REGEX=FORMAT instead"),
    (("--export", "gguf", "--target-size", "lots"), "jgptq: error: --target-size lots: not a positive size such as 24GB or 500MiB"),
    (("--export", "gguf", "--target-size", "0GB"), "jgptq: error: --target-size 0GB: not a positive size such as 24GB or 500MiB"),
    (("--export", "gguf", "--target-bpw", "0"),
     "jgptq: error: PipelineConfig.target_bpw=0.0: must be None or a number of bits per weight in (0, 32]"),
    (("--export", "gguf", "--target-bpw", "3", "--target-formats", "q4_k,q9_k"),
     "jgptq: error: PipelineConfig.target_formats='q9_k': unknown GGML format 'q9_k'; known formats: "),
    (("--export", "gptq", "--target-bpw", "3"),
     "jgptq: error: --target-bpw gives tensors different formats, and a gptq checkpoint holds one bit width for "
     "all; use --export gguf (GGML formats per tensor)"),
    (("--target-size", "2GB"),
     "jgptq: error: --target-size gives tensors different formats, and a compressed-tensors checkpoint holds one "
     "bit width for all; use --export gguf (GGML formats per tensor)"),
])
def test_target_refusals_come_before_anything_is_loaded(unloadable, capsys, extra, message):  # noqa: F811
    got = refused(unloadable, capsys, *extra)
    assert got.startswith(message) if message.endswith(": ") else got == message, got


def test_the_help_lists_the_target_options():
    text = build_parser()._subparsers._group_actions[0].choices["quantize"].format_help()
    for option in ("--target-bpw BITS", "--target-size SIZE", "--target-formats LIST", "--target-gain"):
        assert option in text
    assert isinstance(build_parser().parse_args(ARGS + ["--target-bpw", "2"]), argparse.Namespace)



@pytest.mark.slow     # about 30 s on 2 cores
def test_a_target_size_run_writes_its_allocation_to_the_gguf_file_the_report_and_a_chart(model_dir, env,  # noqa: F811
                                                                                           tmp_path):
    import json

    import gguf
    from transformers import AutoModelForCausalLM

    from jgptq_torch.export.gguf.export import gguf_names
    from jgptq_torch.pipeline.sensitivity import target_weights

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    size = target_weights(model) * 6 // 8                        # 6 bits per weight
    out = tmp_path / "m.gguf"
    done = cli(env, *[a for a in quantize_args(model_dir, out, "--export", "gguf", "--target-size", size,
                                               "--target-formats", "q4_0,q8_0", "--method", "rtn",
                                               "--target-gain", "one") if a != "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jgptq: --target-size %d: 6.0000 bits per weight" % size in done.stderr
    report = json.loads(out.with_name("m.gguf.report.json").read_text())
    a = report["allocation"]
    assert a["target_bpw"] == pytest.approx(6.0) and a["total_bytes"] <= a["budget_bytes"] == size
    assert {g["format"] for g in a["groups"]} == {"q4_0", "q8_0"}
    assert "target 6 bpw: " in done.stdout and f"{'layer':>5} {'tensor group':<28} format" in done.stdout
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    names = gguf_names(model)
    for g in a["groups"]:
        for param in g["params"]:
            assert {types[n] for n, _ in names[param]} == {g["format"]}, param
    # the budget covers the decoder layers' tensors; token_embd and output are written in llama.cpp's types apart
    written = sum(int(t.n_bytes) for t in reader.tensors
                  if t.name.startswith("blk.") and types[t.name] in ("q4_0", "q8_0"))
    assert written == a["total_bytes"]
    assert out.with_name("m.gguf.bits.svg").read_text().startswith("<svg")
