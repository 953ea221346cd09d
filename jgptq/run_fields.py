"""The fields of a :class:`jgptq.config.PipelineConfig` that say where and how visibly a run works, never what
it computes (:data:`jgptq.config.RUN_FIELDS`, the fields marked ``where``): where the layers live between steps (``offload``, ``offload_dir``, ``reload``,
``keep_offload_files``), the device memory budget and the progress bars. A resumed run may change them; the resume
fingerprint hashes every other field (``PipelineConfig.what``). Here too: their checks, and byte sizes as text."""

from __future__ import annotations

import os
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text) -> int:
    """Bytes of ``"40GB"``, ``"500MiB"``, ``"1000000"`` or an int (decimal units for kB/MB/GB/TB, binary for
    KiB/MiB/GiB/TiB).

    Raises:
      ValueError: not a size.
    """
    if isinstance(text, bool):
        raise ValueError(f"size {text!r} is not a number of bytes such as 40GB or 500MiB")
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"size {text!r} is not a number of bytes such as 40GB or 500MiB")
    unit = (m.group(2) or "").lower()
    power = " kmgt".index(unit[0]) if unit and unit[0] in "kmgt" else 0
    base = 1024 if "i" in unit else 1000
    return int(float(m.group(1)) * base**power)



OFFLOADS = ("none", "cpu", "disk")


def fail_in(cls: str, field: str, value, rule: str):
    """Raises the ValueError of every config check: ``cls.field=value: rule``."""
    raise ValueError(f"{cls}.{field}={value!r}: {rule}")


def check_run_fields(config) -> None:
    """Checks (and normalises in place: a folder path as str, a budget in bytes) the run fields of a
    :class:`jgptq.config.PipelineConfig` under construction; ValueError naming the field and the rule."""
    if config.offload not in OFFLOADS:
        fail_in("PipelineConfig", "offload", config.offload, f"must be one of {OFFLOADS}")
    disk = config.offload == "disk"
    if config.offload_dir is not None:
        if not isinstance(config.offload_dir, (str, os.PathLike)) or not os.fspath(config.offload_dir):
            fail_in("PipelineConfig", "offload_dir", config.offload_dir, "must be a folder path or None")
        if not disk:
            fail_in("PipelineConfig", "offload_dir", config.offload_dir, "only used with offload='disk'")
        object.__setattr__(config, "offload_dir", os.fspath(config.offload_dir))
    if config.device_budget is not None:
        try:
            budget = parse_size(config.device_budget)
        except ValueError as exc:
            fail_in("PipelineConfig", "device_budget", config.device_budget, str(exc))
        if budget < 1:
            fail_in("PipelineConfig", "device_budget", config.device_budget, "must be a positive size")
        object.__setattr__(config, "device_budget", budget)
    for name in ("reload", "keep_offload_files"):
        value = getattr(config, name)
        if not isinstance(value, bool):
            fail_in("PipelineConfig", name, value, "must be True or False")
        if value != (name == "reload") and not disk:
            fail_in("PipelineConfig", name, value, "only used with offload='disk'")
        if value != (name == "reload") and config.offload_dir is None:
            fail_in("PipelineConfig", name, value, "needs offload_dir: the layer files stay there after the "
                    "run, so they must not go to a temporary folder")
