"""The README's table of MoE families: what works for each tiny model of :mod:`tests.export.family_models`.

:data:`ROWS` is the one source: ``tests/export/test_family_table.py`` checks every cell against a run of the family
(quantize_moe, a compressed-tensors export reloaded by transformers, the GGUF exporter's architecture or refusal),
the llama.cpp tests run every family whose GGUF cell says so, and the README's table must equal :func:`render`.
"""

import dataclasses

YES = "yes"
REFUSED = "refused"
FAILS = "fails"
NOT_CHECKED = "not checked here"


@dataclasses.dataclass(frozen=True)
class Row:
    """One family's cells.

    Attributes:
      quantize: YES (quantize_moe quantizes every expert) or REFUSED (UnsupportedModelError, with the reason).
      compressed_tensors: YES (transformers reloads the export with the solved weights, logits equal), REFUSED
        (the exporter refuses: a checkpoint keeping fused 3-D expert tensors) or FAILS (exported, but transformers
        does not load it back to the same model).
      gguf: the llama.cpp architecture the GGUF file is written for (run in llama.cpp by the llama.cpp tests), or
        REFUSED (the GGUF exporter refuses the family).
      note: a short reason for a refusal or failure ("" if none).
    """

    quantize: str
    compressed_tensors: str
    gguf: str
    note: str = ""


_FUSED = "the checkpoint keeps fused 3-D expert tensors, which compressed-tensors cannot hold"
ROWS = {
    "mixtral": Row(YES, YES, "llama"),
    "qwen3_moe": Row(YES, YES, "qwen3moe"),
    "qwen2_moe": Row(YES, YES, "qwen2moe"),
    "olmoe": Row(YES, YES, "olmoe"),
    "deepseek_v3": Row(YES, YES, "deepseek2"),
    "glm4_moe": Row(YES, YES, "glm4moe"),
    "dots1": Row(YES, YES, "dots1"),
    "minimax_m2": Row(YES, YES, "minimax-m2"),
    "ernie4_5_moe": Row(YES, YES, "ernie4_5-moe"),
    "hunyuan_v1_moe": Row(YES, YES, "hunyuan-moe"),
    "lfm2_moe": Row(YES, YES, "lfm2moe"),
    "afmoe": Row(YES, YES, "afmoe"),
    "qwen3_next": Row(YES, YES, "qwen3next"),
    "qwen3_5_moe_text": Row(YES, YES, "qwen35moe"),
    "granitemoe": Row(YES, REFUSED, "granitemoe", "compressed-tensors: " + _FUSED),
    "granitemoeshared": Row(YES, REFUSED, "granitemoe", "compressed-tensors: " + _FUSED),
    "gpt_oss": Row(YES, REFUSED, "gpt-oss", "compressed-tensors: " + _FUSED),
    "llama4_text": Row(YES, REFUSED, "llama4", "compressed-tensors: " + _FUSED),
    "phimoe": Row(YES, FAILS, REFUSED,
                  "compressed-tensors: transformers' loader quantizes the router (a Linear subclass) the export "
                  "leaves in floating point, and the load fails; GGUF: llama.cpp's phimoe routes differently"),
    "jetmoe": Row(YES, REFUSED, REFUSED, "compressed-tensors: " + _FUSED + "; GGUF: no llama.cpp architecture"),
}

COLUMNS = ("transformers `model_type`", "`quantize_moe`", "compressed-tensors, reloaded by transformers",
           "GPTQ v1, loaded by GPTQModel", "GGUF, run by llama.cpp (arch)", "notes")


def _gguf_cell(row: Row) -> str:
    return row.gguf if row.gguf == REFUSED else f"yes (`{row.gguf}`)"


def render() -> str:
    """The README's table (markdown, one line per family, a final newline)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for family, row in ROWS.items():
        cells = (family, row.quantize, row.compressed_tensors, NOT_CHECKED, _gguf_cell(row), row.note)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def gguf_families() -> list:
    """Families whose GGUF file llama.cpp runs (the llama.cpp tests' families, with llama)."""
    return [f for f, row in ROWS.items() if row.gguf != REFUSED]
