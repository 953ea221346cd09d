"""Linear-attention (delta-rule / linear-RNN) mixers: found by class name, and the warning a GPU run gets when
transformers would run them through its slow reference kernels."""

from __future__ import annotations

import re

import torch
from torch import nn

# Class-name fragments of the linear-attention (delta-rule / linear-RNN) mixers that transformers runs through its
# slow pure-torch reference kernels unless the flash-linear-attention kernels (PyPI ``fla-core``) are importable.
_LINEAR_ATTENTION = re.compile(r"(GatedDeltaNet|DeltaNet|DeltaAttention|LinearAttention|LightningAttention)")

FLA_ADVICE = ("install the flash-linear-attention kernels with `pip install fla-core` (GPU only: with it installed, "
              "CPU forwards of these models fail)")


def linear_attention_modules(model: nn.Module) -> list[str]:
    """Class names of the model's linear-attention mixers (empty for models with softmax attention only)."""
    return sorted({type(m).__name__ for m in model.modules() if _LINEAR_ATTENTION.search(type(m).__name__)})


def slow_linear_attention(model: nn.Module, device) -> str | None:
    """A warning when calibrating ``model`` on ``device`` would run transformers' slow linear-attention kernels.

    Linear-attention models (Qwen3-Next, Qwen3.5, GLM-5 Next, Kimi Linear, OLMo Hybrid, ...) fall back to
    token-by-token reference implementations in torch when the ``fla`` package is missing; on a GPU that makes
    the calibration forward the slowest stage by far. Returns None when there is nothing to say: no such layers,
    a CPU run (the fast kernels are GPU-only), or the kernels are available.
    """
    names = linear_attention_modules(model)
    if not names or torch.device(device).type == "cpu":
        return None
    try:
        from transformers.utils.import_utils import is_flash_linear_attention_available
    except ImportError:  # older transformers: look for the package itself
        import importlib.util

        def is_flash_linear_attention_available():
            return importlib.util.find_spec("fla") is not None
    if is_flash_linear_attention_available():
        return None
    return (f"{type(model).__name__} has linear-attention layers ({', '.join(names)}) and the flash-linear-attention "
            f"kernels are not importable: transformers will run its slow reference kernels for every calibration "
            f"and replay forward; {FLA_ADVICE}")
