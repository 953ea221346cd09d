"""The command line's offload options: parsed into the pipeline configuration, bad values and over-budget runs
refused with a clear message before anything is written."""

from jgptq_torch.cli.main import build_parser, main
from tests.cli.test_cli import model_dir, quantize_args, tree  # noqa: F401  (model_dir is a fixture)


def test_offload_options_reach_the_pipeline_configuration():
    from jgptq_torch.cli.command import build_config

    args = build_parser().parse_args(["quantize", "m", "--calib", "c.txt", "--out", "o", "--offload", "disk",
                                      "--offload-dir", "/data/layers", "--device-budget", "40GB"])
    cfg = build_config(args, "bfloat16")
    assert (cfg.offload, cfg.offload_dir, cfg.device_budget) == ("disk", "/data/layers", 40 * 10**9)
    default = build_config(build_parser().parse_args(["quantize", "m", "--calib", "c.txt", "--out", "o"]), "bfloat16")
    assert (default.offload, default.offload_dir, default.device_budget) == ("none", None, None)


def test_bad_offload_options_and_over_budget_runs_are_refused(model_dir, tmp_path, capsys):  # noqa: F811
    def fails(extra, message):
        before = tree(tmp_path)
        assert main([str(a) for a in quantize_args(model_dir, tmp_path / "out", *extra)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("jgptq: error: ") and message in err, err
        assert tree(tmp_path) == before

    fails(["--offload-dir", tmp_path / "layers"], "only used with offload='disk'")
    fails(["--device-budget", "lots"], "'lots' is not a number of bytes")
    fails(["--offload", "disk", "--device-budget", "1kB"], "decoder layer 0 alone needs about")


def test_a_disk_offload_without_a_folder_keeps_its_layers_in_the_working_folder(tmp_path):
    from jgptq.command_config import config_of

    args = build_parser().parse_args(["quantize", "m", "--calib", "c.txt", "--out", "o", "--offload", "disk"])
    assert config_of(args, "bfloat16", tmp_path / "o.jgptq-work").offload_dir == str(tmp_path / "o.jgptq-work" /
                                                                                       "offload")
    assert config_of(args, "bfloat16").offload_dir is None
    given = build_parser().parse_args(["quantize", "m", "--calib", "c.txt", "--out", "o", "--offload", "disk",
                                       "--offload-dir", "/data/layers"])
    assert config_of(given, "bfloat16", tmp_path).offload_dir == "/data/layers"
