"""The token embedding and the output head of a GGML run's GGUF file, in the types llama.cpp's quantizer gives them
for the run (:func:`jgptq.plan.edge_formats`): a plain encode, with the run's importance statistic of the head
where it has one. The pipeline quantizes neither; the exporters do, and add each to the run's report.

:func:`edge_choices` says what each gets (format, importance), :func:`encode_edges` encodes them and
:func:`report_edges` adds them to the report, so that a file written during the run can encode them early on a
guess of the run's formats and keep them when the finished run makes the same choices.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

import numpy as np
import torch

from jgptq.export.records import GGMLWeight


class EdgeChoice(NamedTuple):
    """What one edge parameter gets: its role (``"embedding"`` / ``"output"``), GGML format and importance
    (float32 (cols,) or None)."""

    role: str
    format: str
    importance: Optional[np.ndarray]

    def same(self, other) -> bool:
        if other is None or (self.role, self.format) != (other.role, other.format):
            return False
        if self.importance is None or other.importance is None:
            return self.importance is None and other.importance is None
        return bool(np.array_equal(self.importance, other.importance))


def edge_choices(result, plan: dict, state: dict, records, formats: Counter) -> dict:
    """Parameter -> :class:`EdgeChoice` of the embedding and the head (none for an integer run, a result without
    a config, or a parameter that ``records`` (parameter names) already holds); ``formats`` counts the run's
    weights per format (its dominant one names the file type)."""
    from jgptq.plan import edge_formats

    config = getattr(result, "config", None)
    roles = {p: e[0].role for p, e in plan.items() if e and e[0].role in ("embedding", "output")}
    if not roles or not getattr(getattr(config, "quant", None), "is_ggml", False):
        return {}
    tied = "output" not in roles.values() and not any(plan[p] and plan[p][0].role == "output" for p in records)
    cols = int(state[next(iter(roles))].shape[-1])
    edge = edge_formats(config, cols, tied, formats.most_common(1)[0][0] if formats else None)
    out = {}
    for param, role in roles.items():
        fmt = edge.get("token_embd" if role == "embedding" else "output")
        if fmt is None or param in records:
            continue
        entry = (getattr(result, "imatrix", None) or {}).get(param)
        importance = None
        if entry is not None and role == "output":   # llama.cpp's imatrix never holds the embedding
            importance = np.asarray(entry[0], np.float32).reshape(-1) / max(float(np.asarray(entry[1]).sum()), 1.0)
        out[param] = EdgeChoice(role, fmt, importance)
    return out


def encode_edges(state: dict, choices: dict) -> dict:
    """Parameter -> :class:`GGMLWeight` (plain encode, ``method="rtn"``) of each choice."""
    import jgptq.ggml as ggml

    out = {}
    for param, c in choices.items():
        weight = state[param].detach().to("cpu", torch.float32).numpy()
        out[param] = GGMLWeight(np.asarray(ggml.encode(weight, c.format, c.importance)).reshape(
            weight.shape[0], -1, ggml.get_format(c.format).type_size), c.format, method="rtn")
    return out


def report_edges(result, plan: dict, state: dict, choices: dict) -> None:
    """Adds each choice to ``result.report.records`` (once: layer -1, method ``rtn``, the reason)."""
    from jgptq_torch.report import ModuleRecord

    report = getattr(result, "report", None)
    if report is None:
        return
    for param, c in choices.items():
        if any(r.name == param and r.layer == -1 for r in report.records):
            continue
        name = plan[param][0].name.removesuffix(".weight")
        report.records.append(ModuleRecord(
            name=param, layer=-1, kind=name, shape=tuple(state[param].shape), tokens=0, method="rtn",
            reason=f"llama.cpp's type of {name} for this run" + (" (with importance)" if c.importance is not None
                                                                  else ""), format=c.format))


def edge_records(result, plan: dict, state: dict, records, formats: Counter) -> dict:
    """:func:`edge_choices` encoded (:func:`encode_edges`) and reported (:func:`report_edges`)."""
    choices = edge_choices(result, plan, state, records, formats)
    out = encode_edges(state, choices)
    report_edges(result, plan, state, choices)
    return out
