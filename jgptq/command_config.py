"""The :class:`jgptq.config.PipelineConfig` of the ``jgptq quantize`` options, resolved in one call.

:func:`config_of` reads every option of a configuration field as the field declares it (:mod:`jgptq.options`) and
decides what no one field says: the scale dtype the exporter stores, the format a mix or a target runs on, and the
``target_*`` fields, which only a budget turns on (:func:`target_fields`). What the chosen exporter can hold is the
command's own check, made on the config this returns. Imports neither torch nor JAX.
"""

from __future__ import annotations

from pathlib import Path

from jgptq import mixes
from jgptq.config import MoEConfig, PipelineConfig, QuantConfig
from jgptq.config import parse_size as config_size
from jgptq.export.records import SCALE_DTYPES
from jgptq.options import CommandError, config_values

# The fields of a bits budget: set from their options only when --target-bpw or --target-size gives a budget.
TARGET_FIELDS = ("target_bpw", "target_formats", "target_gain")

# --target-size is a size in bytes: it becomes bits per weight once the model's weights are counted (after the
# model is loaded); until then the config holds this placeholder, so that every other check runs before loading.
SIZE_PLACEHOLDER_BPW = 16.0


def config_of(args, dtype: str, work=None) -> PipelineConfig:
    """The pipeline configuration of the parsed ``jgptq quantize`` options ``args`` for a model of ``dtype``
    (``"float16"``, ``"bfloat16"``, ...): scales stored as the exporter ``args.export`` needs them; ``work``: the
    run's working folder (a path), where ``--offload disk`` keeps its layer files (its ``offload`` folder) unless
    ``--offload-dir`` says otherwise (None: no default).

    Raises:
      CommandError: options no run can use together; ValueError: an invalid option (the config's message).
    """
    if args.export == "gptq":
        scale_dtype = "float16"          # GPTQ v1 stores float16 scales
    elif dtype in SCALE_DTYPES:
        scale_dtype = dtype              # compressed-tensors: the model dtype, so loaders decode exactly
    else:
        scale_dtype = "float16"
    fields = {**config_values(args, MoEConfig), **config_values(args, PipelineConfig)}
    target = target_fields(args, fields)
    fmt = args.format
    if target and args.export == "gguf" and fmt == "int":
        fmt = "q4_k"   # a GGML run; the target gives every tensor its own format
    fmt = mixes.run_format(args.mix, fmt)   # the format the exporter's check must see
    quant = QuantConfig(**{**config_values(args, QuantConfig), "format": fmt, "scale_dtype": scale_dtype})
    fields = {name: value for name, value in fields.items() if name not in TARGET_FIELDS}
    cfg = PipelineConfig.build(None, quant=quant, **fields, **target)
    if work is not None and cfg.offload == "disk" and cfg.offload_dir is None:   # beside the run's state
        cfg = PipelineConfig.build(cfg, offload_dir=str(Path(work) / "offload"))
    return cfg


def target_fields(args, fields: dict) -> dict:
    """The ``target_*`` config fields of ``--target-bpw``/``--target-size``/``--target-formats``/``--target-gain``
    (empty without a target); ``fields``: the values of the options of :class:`PipelineConfig`. Raises
    CommandError for a combination no run can use."""
    given = {name: value for name, value in fields.items() if name in TARGET_FIELDS}
    bpw, size, formats = given["target_bpw"], getattr(args, "target_size", None), given["target_formats"]
    if bpw is not None and size is not None:
        raise CommandError("--target-bpw and --target-size both set the budget; give one of them")
    if bpw is None and size is None:
        if formats:
            raise CommandError("--target-formats needs a budget: --target-bpw BITS or --target-size SIZE")
        return {}
    flag = "--target-bpw" if bpw is not None else "--target-size"
    if args.export != "gguf":
        raise CommandError(f"{flag} gives tensors different formats, and a {args.export} checkpoint holds one bit "
                           f"width for all; use --export gguf (GGML formats per tensor)")
    if args.mix is not None:
        raise CommandError(f"{flag} chooses every tensor's format and cannot be combined with --mix {args.mix}; fix "
                           f"some tensors with --tensor-format REGEX=FORMAT instead")
    if size is not None:
        try:
            if config_size(size) < 1:
                raise ValueError
        except ValueError:
            raise CommandError(f"--target-size {size}: not a positive size such as 24GB or 500MiB") from None
    return {**given, "target_bpw": bpw if bpw is not None else SIZE_PLACEHOLDER_BPW}
