"""A target_bpw budget the candidates cannot reach is refused before any work, with the range they reach; the
default candidates fit the model's widths; the first pass says what it will do before doing it, then reports each
layer with an estimate of the time left."""

import pytest

import jgptq
from jgptq import allocate
from jgptq.config import PipelineConfig
from jgptq.surface import command_line
from jgptq_torch.cli.main import main
from jgptq_torch.pipeline import gains, measure, sensitivity
from tests.cli.test_cli import CALIB, model_dir  # noqa: F401 - the fixture
from tests.tiny_models import build, token_ids


def no_work(monkeypatch):
    """Fails the test if the first pass starts measuring (gains or the per-layer solves)."""
    monkeypatch.setattr(measure, "Measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(gains, "fisher_gains", lambda *a, **k: pytest.fail("gains computed"))


def run_cli(model_dir, tmp_path, capsys, *extra):  # noqa: F811
    args = ["quantize", model_dir, "--calib", CALIB, "--out", tmp_path / "o.gguf", "--samples", 4, "--seq-len", 32,
            "--export", "gguf", *extra]
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_default_candidates_take_llama_cpp_fallbacks_for_widths_the_256_blocks_do_not_divide():
    cfg = PipelineConfig.build(None, format="q4_k", target_bpw=3.0)
    assert allocate.candidates(cfg, 128) == ("iq4_nl", "q4_0", "q5_0", "q5_1", "q8_0")
    assert allocate.candidates(cfg, 512) == allocate.GGML_FAMILY          # unchanged where the blocks fit
    explicit = PipelineConfig.build(None, format="q4_k", target_bpw=3.0, target_formats=("q4_k", "q8_0"))
    assert allocate.candidates(explicit, 128) == ("q8_0",)               # a list the user gave is kept as given


def test_the_help_example_budget_is_reachable_on_a_model_with_128_wide_experts():
    model = build("qwen3_moe", hidden_size=256, moe_intermediate_size=128, head_dim=64)   # o_proj 256 wide
    cfg = PipelineConfig.build(None, format="q4_k", target_bpw=2.5)
    (free, fixed, weights), n_layers = sensitivity._layout(cfg, model)
    assert n_layers == model.config.num_hidden_layers
    least, most, cheapest, largest = sensitivity.reachable(free, fixed, weights)
    # down_proj (input 128 wide) at iq4_nl (4.5 bits), every 256-wide matrix at iq1_s (1.5625 bits)
    down = sum(m.count * m.rows * m.cols for _, _, m, _ in free.values() if m.cols == 128)
    assert least == pytest.approx(down * 4.5 + (weights - down) * 1.5625)
    assert least / weights < 2.5 and cheapest == {"iq1_s", "iq4_nl"} and largest == {"q8_0"}
    sensitivity._check_reachable(cfg, free, fixed, weights)   # no refusal


def test_a_budget_above_the_largest_candidates_is_refused_before_any_work_in_python(monkeypatch):
    no_work(monkeypatch)
    with pytest.raises(ValueError) as err:
        jgptq.quantize_moe(build("qwen3_moe"), token_ids(8, 32, seed=1), batch_size=8, progress=False,
                           format="q4_k", target_bpw=20.0)
    assert str(err.value) == ("target_bpw=20 is above the 8.5 bits per weight of every tensor at its largest "
                              "candidate (q8_0): the candidates reach 4.5 .. 8.5 bits per weight of this model; "
                              "choose a target in that range")


@pytest.mark.parametrize("bpw, message", [
    ("20", "jgptq: error: --target-bpw 20 is above the 8.5 bits per weight of every tensor at its largest candidate "
           "(q8_0): the candidates reach 4.5 .. 8.5 bits per weight of this model; choose a target in that range"),
    ("3", "jgptq: error: --target-bpw 3 is below the 4.5 bits per weight of every tensor at its cheapest candidate "
          "(iq4_nl); raise it or add cheaper --target-formats LIST"),
])
def test_the_command_line_refuses_an_unreachable_budget_with_its_flag(model_dir, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                                      bpw, message):
    no_work(monkeypatch)
    code, err = run_cli(model_dir, tmp_path, capsys, "--target-bpw", bpw, "--quiet")
    assert code == 1 and err.strip().splitlines()[-1] == message, err


def test_the_first_pass_says_what_it_will_do_before_it_starts(model_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    class Stop(ValueError):
        pass

    def stop(*args, **kwargs):
        raise Stop("stopped at the gains")

    monkeypatch.setattr(gains, "fisher_gains", stop)
    code, err = run_cli(model_dir, tmp_path, capsys, "--target-bpw", "5")
    lines = err.splitlines()
    assert code == 1 and lines[-1] == "jgptq: error: stopped at the gains"
    # 3 layers x (4 attention matrices + 2 expert stacks), each under the 5 candidates that fit widths 64 and 32
    assert ("jgptq: --target-bpw 5: a first pass solves every layer under each of 5 candidate formats (iq4_nl, "
            "q4_0, q5_0, q5_1, q8_0): 90 matrix stacks over 3 layers, about 5.0 times the rows the run that "
            "follows solves; the candidates reach 4.5 .. 8.5 bits per weight") in lines


def test_option_names_follow_where_the_code_runs():
    from jgptq.surface import option

    assert option("overwrite") == "overwrite=True" and option("target_bpw", 2.5) == "target_bpw=2.5"
    assert option("block_fallback", "llama.cpp") == "block_fallback='llama.cpp'"
    with command_line():
        assert option("overwrite") == "--overwrite" and option("target_bpw", 2.5) == "--target-bpw 2.5"
        assert option("formats") == "--tensor-format REGEX=FORMAT"
    assert option("exclude") == "exclude=[...]"


def test_a_block_size_refusal_names_the_flags_under_the_command_line(model_dir, tmp_path, capsys):  # noqa: F811
    code, err = run_cli(model_dir, tmp_path, capsys, "--format", "q4_k", "--quiet")
    assert code == 1 and err.strip().splitlines()[-1] == (
        "jgptq: error: model.layers.0.self_attn.q_proj.weight: 64 input columns are not a multiple of the q4_k block "
        "size 256; choose another format for it with --tensor-format REGEX=FORMAT, a fallback with --block-fallback "
        "llama.cpp (or a format name), or leave it unquantized with --exclude REGEX"), err


def test_a_block_size_refusal_names_the_arguments_in_python():
    with pytest.raises(ValueError) as err:
        jgptq.quantize_moe(build("qwen3_moe"), token_ids(8, 32, seed=1), batch_size=8, progress=False, format="q4_k")
    assert str(err.value).endswith(
        "choose another format for it with formats=[(regex, format)], a fallback with block_fallback='llama.cpp' or "
        "a format name, or leave it unquantized with exclude=[...]")
