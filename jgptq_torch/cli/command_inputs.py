"""What every command of the command line shares on the torch side: its error, the checks of a model folder and an
output path, the files a run writes beside its output, and the one-line log on stderr.

:mod:`jgptq_torch.cli.command` (``jgptq quantize``), :mod:`jgptq_torch.cli.demo` and :mod:`jgptq_torch.cli.evaluate` (``jgptq eval``) take
these from here, so that no command reaches into another.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jgptq.config import parse_size as config_size
from jgptq.options import CommandError

# CommandError (jgptq.options): the commands' error; an option's value that cannot be read raises it too.


def parse_size(text: str) -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"1000000"`` (decimal units for kB/MB/GB, binary for KiB/MiB/GiB)."""
    try:
        return max(1, config_size(text))
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def paths_for(out) -> dict:
    """The files a run writes beside its output folder ``out``."""
    out = Path(out)
    return {"out": out, "work": out.with_name(out.name + ".jgptq-work"),
            "report": out.with_name(out.name + ".report.json"), "plot": out.with_name(out.name + ".loss.svg"),
            "bits": out.with_name(out.name + ".bits.svg")}


def check_output(out, overwrite: bool) -> None:
    """Refuses an existing non-empty output (file or folder) unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"output {str(out)!r} already exists; pass --overwrite to replace it (it is replaced "
                           f"whole, only once the new checkpoint is complete), or choose another --out")


def check_model_dir(model_dir) -> Path:
    """The model folder, after checking that it holds a config.json and safetensors weights."""
    p = Path(model_dir)
    if not p.exists():
        raise CommandError(f"model directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CommandError(f"{str(p)!r} is not a directory (expected a local transformers model folder)")
    if not (p / "config.json").is_file():
        raise CommandError(f"{str(p)!r} has no config.json; it is not a transformers model folder")
    read_config(p)
    if not any(p.glob("*.safetensors")):
        raise CommandError(f"{str(p)!r} holds no .safetensors weights; jgptq loads safetensors only (convert "
                           f"the checkpoint first, e.g. load it and call save_pretrained)")
    return p


def read_config(model_dir: Path) -> dict:
    """The JSON object of ``model_dir``/config.json; refuses a file that is not one, naming it and where it breaks."""
    import json

    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); restore it from the "
                           f"model's source") from None
    except json.JSONDecodeError as exc:
        size = path.stat().st_size
        ends = exc.msg.startswith("Unterminated") or exc.pos >= len(exc.doc.rstrip())
        cut = " (the file ends before the JSON does: it looks truncated)" if ends else ""
        where = f"line {exc.lineno}, column {exc.colno} (character {exc.pos} of {size} bytes)"
        raise CommandError(f"{path} is not valid JSON: {exc.msg.removesuffix(' at')} at {where}{cut}; restore it "
                           f"from the model's source") from None
    if not isinstance(cfg, dict):
        raise CommandError(f"{path} holds a JSON {type(cfg).__name__}, not the object of a model's configuration")
    return cfg


def model_dtype(model_dir: Path, requested: str) -> str:
    """The dtype the model loads in: ``requested``, or (``auto``) the one its config.json names."""
    if requested != "auto":
        return requested
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return dtype if isinstance(dtype, str) else "float32"


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"jgptq: {msg}", file=sys.stderr, flush=True)
