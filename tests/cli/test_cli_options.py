"""The ``jgptq quantize`` options: for representative command lines, the parsed options and the pipeline
configuration they build, against values written down from the command line as it was written by hand, before its
options were generated from the configuration's fields; and the parser's options one by one (flag, destination,
default, choices, arity, type, metavar, group)."""

import dataclasses

import pytest

from jgptq.config import PipelineConfig
from jgptq.methods import registry
from jgptq_torch.cli import command
from jgptq_torch.cli.main import build_parser

QUANTIZE = ["quantize", "m", "--calib", "c.txt", "--out", "o"]

DEFAULT_NAMESPACE = {
    "act_order": "auto", "batch_size": 8, "bits": 4, "block_fallback": "error", "calib": "c.txt",
    "calibration": "routed", "command": "quantize", "damp": 0.01, "device": None, "device_budget": None,
    "dtype": "auto", "exclude": None, "export": "compressed-tensors", "float_embeddings": False, "format": "int",
    "gptq_names": "checkpoint", "group_size": 128, "hessian_dtype": "float32", "imatrix_source": "replay",
    "importance": "imatrix", "load": None, "max_shard_size": "5GB", "method": "gptq", "min_tokens": 1, "mix": None,
    "model_dir": "m", "offload": "none", "offload_dir": None, "out": "o", "overwrite": False, "quiet": False,
    "resume": True, "router_weighting": "none", "samples": 128, "seq_len": 512, "sym": True, "target_bpw": None,
    "target_formats": None, "target_gain": "fisher", "target_size": None, "tensor_format": None, "tokenizer": None,
    "traceback": False, "trust_remote_code": False}

# (options after QUANTIZE, the model dtype, the namespace's changes from DEFAULT_NAMESPACE, the configuration's
# changes from PipelineConfig(): "quant.bits" names a field of the nested QuantConfig)
CASES = [
    ([], "bfloat16", {}, {"max_length": 512, "quant.scale_dtype": "bfloat16"}),
    (["--export", "gptq", "--bits", "3", "--group-size", "64", "--asym", "--act-order", "desc", "--damp", "0.05",
      "--method", "rtn"], "float16",
     {"act_order": "desc", "bits": 3, "damp": 0.05, "export": "gptq", "group_size": 64, "method": "rtn",
      "sym": False},
     {"max_length": 512, "method": "rtn", "quant.act_order": "desc", "quant.bits": 3, "quant.damp": 0.05,
      "quant.group_size": 64, "quant.sym": False}),
    (["--act-order", "--sym", "--quiet", "--exclude", "self_attn", "--exclude", "shared_expert", "--hessian-dtype",
      "bfloat16", "--batch-size", "4", "--seq-len", "256", "--samples", "32"], "float32",
     {"act_order": "group_aware", "batch_size": 4, "exclude": ["self_attn", "shared_expert"],
      "hessian_dtype": "bfloat16", "quiet": True, "samples": 32, "seq_len": 256},
     {"batch_size": 4, "exclude": ("self_attn", "shared_expert"), "hessian_dtype": "bfloat16", "max_length": 256,
      "progress": False, "quant.act_order": "group_aware", "quant.scale_dtype": "float32"}),
    (["--export", "gguf", "--mix", "q4_k_m", "--tensor-format", "v_proj$=q8_0", "--tensor-format", "experts=iq4_xs",
      "--importance", "hessian", "--imatrix-source", "float", "--block-fallback", "llama.cpp"], "bfloat16",
     {"block_fallback": "llama.cpp", "export": "gguf", "imatrix_source": "float", "importance": "hessian",
      "mix": "q4_k_m", "tensor_format": ["v_proj$=q8_0", "experts=iq4_xs"]},
     {"block_fallback": "llama.cpp", "formats": (("v_proj$", "q8_0"), ("experts", "iq4_xs")),
      "imatrix_source": "float", "importance": "hessian", "max_length": 512, "mix": "q4_k_m",
      "quant.act_order": "none", "quant.format": "q4_k", "quant.scale_dtype": "bfloat16"}),
    (["--export", "gguf", "--target-bpw", "2.5", "--target-formats", "q2_k, q4_k", "--target-gain", "one"], "float32",
     {"export": "gguf", "target_bpw": 2.5, "target_formats": "q2_k, q4_k", "target_gain": "one"},
     {"max_length": 512, "quant.act_order": "none", "quant.format": "q4_k", "quant.scale_dtype": "float32",
      "target_bpw": 2.5, "target_formats": ("q2_k", "q4_k"), "target_gain": "one"}),
    (["--export", "gguf", "--format", "q4_k", "--target-size", "24GB"], "float32",
     {"export": "gguf", "format": "q4_k", "target_size": "24GB"},
     {"max_length": 512, "quant.act_order": "none", "quant.format": "q4_k", "quant.scale_dtype": "float32",
      "target_bpw": 16.0}),
    (["--calibration", "all_experts", "--min-tokens", "16", "--offload", "disk", "--offload-dir", "d",
      "--device-budget", "40GB", "--act-order", "group_aware"], "float16",
     {"act_order": "group_aware", "calibration": "all_experts", "device_budget": "40GB", "min_tokens": 16,
      "offload": "disk", "offload_dir": "d"},
     {"device_budget": 40000000000, "max_length": 512, "moe.calibration": "all_experts", "moe.min_tokens": 16,
      "offload": "disk", "offload_dir": "d", "quant.act_order": "group_aware"}),
    (["--router-weighting", "squared", "--format", "q6_k", "--export", "gguf", "--importance", "none",
      "--group-size", "-1", "--block-fallback", "Q8_0"], "bfloat16",
     {"block_fallback": "Q8_0", "export": "gguf", "format": "q6_k", "group_size": -1, "importance": "none",
      "router_weighting": "squared"},
     {"block_fallback": "q8_0", "importance": "none", "max_length": 512, "moe.router_weighting": "squared",
      "quant.act_order": "none", "quant.format": "q6_k", "quant.group_size": -1, "quant.scale_dtype": "bfloat16"}),
    (["--no-resume", "--load", "all", "--device", "cpu", "--dtype", "bfloat16", "--export", "gptq", "--gptq-names",
      "modules", "--target-gain", "one", "--offload", "cpu", "--traceback", "--max-shard-size", "1GB",
      "--tokenizer", "t", "--trust-remote-code", "--overwrite", "--float-embeddings"], "bfloat16",
     {"device": "cpu", "dtype": "bfloat16", "export": "gptq", "float_embeddings": True, "gptq_names": "modules",
      "load": "all", "max_shard_size": "1GB", "offload": "cpu", "overwrite": True, "resume": False,
      "target_gain": "one", "tokenizer": "t", "traceback": True, "trust_remote_code": True},
     {"max_length": 512, "offload": "cpu"}),
]


def changes(config: PipelineConfig) -> dict:
    """The fields of ``config`` that differ from ``PipelineConfig()``, nested ones as ``quant.bits``."""
    base = PipelineConfig()
    out = {}
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in dataclasses.fields(value)
                        if getattr(value, g.name) != getattr(default, g.name)})
        elif value != default:
            out[f.name] = value
    return out


@pytest.mark.parametrize("extra, dtype, namespace, config", CASES, ids=[" ".join(c[0][:4]) or "defaults"
                                                                       for c in CASES])
def test_a_command_line_parses_and_builds_the_configuration_it_always_did(extra, dtype, namespace, config):
    args = build_parser().parse_args(QUANTIZE + extra)
    assert vars(args) == {**DEFAULT_NAMESPACE, **namespace}
    assert changes(command.build_config(args, dtype)) == config


# (flags, dest, default, choices, nargs, const, type, metavar, required) of every option, group by group
SUPPRESS = "==SUPPRESS=="
OPTIONS = {
    "positional arguments": [((), "model_dir", None, None, None, None, None, "MODEL_DIR", True)],
    "options": [
        (("-h", "--help"), "help", SUPPRESS, None, 0, None, None, None, False),
        (("--calib",), "calib", None, None, None, None, None, "FILE_OR_DIR", True),
        (("--out",), "out", None, None, None, None, None, None, True),
        (("--export",), "export", "compressed-tensors", ("compressed-tensors", "gptq", "gguf"), None, None, None,
         None, False),
        (("--float-embeddings",), "float_embeddings", False, None, 0, True, None, None, False),
        (("--gptq-names",), "gptq_names", "checkpoint", ("checkpoint", "modules"), None, None, None, None, False)],
    "quantization": [
        (("--format",), "format", "int", None, None, None, None, None, False),
        (("--bits",), "bits", 4, None, None, None, int, None, False),
        (("--group-size",), "group_size", 128, None, None, None, int, None, False),
        (("--sym",), "sym", True, None, 0, True, None, None, False),
        (("--asym",), "sym", True, None, 0, False, None, None, False),
        (("--act-order",), "act_order", "auto", ("auto", "none", "desc", "static", "group_aware"), "?",
         "group_aware", None, None, False),
        (("--damp",), "damp", 0.01, None, None, None, float, None, False),
        (("--method",), "method", "gptq", tuple(registry.names()), None, None, None, None, False),
        (("--mix",), "mix", None, ("q4_k_m", "q5_k_m", "q4_k_s", "q5_k_s", "q3_k_m", "q6_k", "q2_k_s", "iq2_m",
                                   "mxfp4_moe"), None, None, None, None, False),
        (("--tensor-format",), "tensor_format", None, None, None, None, None, "REGEX=FORMAT", False),
        (("--importance",), "importance", "imatrix", ("imatrix", "hessian", "none"), None, None, None, None, False),
        (("--imatrix-source",), "imatrix_source", "replay", ("replay", "float"), None, None, None, None, False),
        (("--target-bpw",), "target_bpw", None, None, None, None, float, "BITS", False),
        (("--target-size",), "target_size", None, None, None, None, None, "SIZE", False),
        (("--target-formats",), "target_formats", None, None, None, None, None, "LIST", False),
        (("--target-gain",), "target_gain", "fisher", ("fisher", "one"), None, None, None, None, False),
        (("--block-fallback",), "block_fallback", "error", None, None, None, None, "FORMAT", False)],
    "calibration": [
        (("--calibration",), "calibration", "routed", ("routed", "all_experts"), None, None, None, None, False),
        (("--min-tokens",), "min_tokens", 1, None, None, None, int, None, False),
        (("--router-weighting",), "router_weighting", "none", ("none", "linear", "squared"), None, None, None,
         None, False),
        (("--samples",), "samples", 128, None, None, None, int, None, False),
        (("--seq-len",), "seq_len", 512, None, None, None, int, None, False),
        (("--batch-size",), "batch_size", 8, None, None, None, int, None, False),
        (("--tokenizer",), "tokenizer", None, None, None, None, None, "DIR", False)],
    "run": [
        (("--device",), "device", None, None, None, None, None, None, False),
        (("--dtype",), "dtype", "auto", ("auto", "bfloat16", "float16", "float32"), None, None, None, None, False),
        (("--load",), "load", None, ("stream", "all"), None, None, None, None, False),
        (("--hessian-dtype",), "hessian_dtype", "float32", ("float32", "bfloat16"), None, None, None, None, False),
        (("--exclude",), "exclude", None, None, None, None, None, "REGEX", False),
        (("--offload",), "offload", "none", ("none", "cpu", "disk"), None, None, None, None, False),
        (("--offload-dir",), "offload_dir", None, None, None, None, None, "DIR", False),
        (("--device-budget",), "device_budget", None, None, None, None, None, "SIZE", False),
        (("--max-shard-size",), "max_shard_size", "5GB", None, None, None, None, None, False),
        (("--trust-remote-code",), "trust_remote_code", False, None, 0, True, None, None, False),
        (("--overwrite",), "overwrite", False, None, 0, True, None, None, False),
        (("--resume", "--no-resume"), "resume", True, None, 0, None, None, None, False),
        (("--quiet",), "quiet", False, None, 0, True, None, None, False),
        (("--traceback",), "traceback", SUPPRESS, None, 0, True, None, None, False)],
}


def test_the_quantize_options_are_the_ones_they_always_were():
    quantize = build_parser()._subparsers._group_actions[0].choices["quantize"]
    found = {g.title: [(tuple(a.option_strings), a.dest, a.default, None if a.choices is None else tuple(a.choices),
                        a.nargs, a.const, a.type, a.metavar, a.required) for a in g._group_actions]
             for g in quantize._action_groups}
    assert found == OPTIONS
    for action in quantize._actions:   # every option says what it does
        assert action.help, action.option_strings


def test_every_declared_option_is_on_the_command_line_once_and_messages_name_it():
    from jgptq.options import declared, flag_of
    from jgptq.surface import command_line, option

    quantize = build_parser()._subparsers._group_actions[0].choices["quantize"]
    flags = [s for a in quantize._actions for s in a.option_strings]
    paths = declared()
    assert len(paths) == 26 and "quant.bits" in paths and "moe.min_tokens" in paths
    for path in paths:
        name = path.rsplit(".", 1)[-1]
        assert flags.count(flag_of(name).name) == 1, path
        with command_line():
            assert option(name, 3).split()[0] == flag_of(name).name
        assert option(name, 3) == f"{name}=3"
    with command_line():
        assert (option("max_length", 512), option("exclude"), option("device", "cpu")) == (
            "--seq-len 512", "--exclude REGEX", "--device cpu")
        with pytest.raises(KeyError):
            option("keep_hessians", True)   # a field with no option: no flag to name


def test_a_rule_that_is_not_regex_equals_format_is_refused_naming_the_option():
    from jgptq.options import CommandError, format_rules

    assert format_rules(["a=b=q8_0", "v_proj$=q6_k"]) == (("a=b", "q8_0"), ("v_proj$", "q6_k"))
    for bad in ("v_proj", "=q8_0", "v_proj="):
        with pytest.raises(CommandError, match="--tensor-format .*expected REGEX=FORMAT"):
            format_rules([bad])
