"""The run's inputs of a layer's weights paired with the float model's at the same tokens: the rows of the
error-feedback cross statistic (:func:`jgptq.statistics.error_cross`), ``[x | x~]`` on the last axis.

The float layer runs first on a batch of the float stream with a recording collector (the partner,
:class:`jgptq_torch.pipeline.capture.Collector` with ``record=True``), then on the run's batch with the run's
collector; the layer's weights are float in both (calibration precedes the layer's solve), so the two inputs of a
weight differ only by what the earlier, quantized layers changed.

- A linear module: its input in the float forward, token for token (same batch, same positions).
- Experts, under the run's routing (the router sees the run's inputs; a token's float routing may differ): each
  routed token's gate/up row is paired with the float experts module's input at that token, ``x~_t``, and its down
  row ``act(up_e(x_t))`` with ``act(up_e(x~_t))``, the float expert's activation of the float input, computed here
  with the same expert's weights (:func:`jgptq_torch.pipeline.experts_capture.down_inputs`). So each expert's
  cross statistic is over the tokens its Hessian sees, with the targets the float expert would give them.
"""

from __future__ import annotations

import torch

from jgptq_torch.models import UnsupportedModelError
from jgptq_torch.pipeline.experts_capture import down_inputs


def _recorded(partner, name: str) -> torch.Tensor:
    got = partner.recorded.get(name)
    if got is None:
        raise UnsupportedModelError(f"{name}: the float layer's forward did not show its input to jgptq's capture; "
                                    f"error feedback cannot pair its rows (experts that transformers does not "
                                    f"dispatch, or a data flow that differs between forwards)")
    return got


def linear_pairs(partner, name: str, rows: torch.Tensor) -> torch.Tensor:
    """(N, 2C): the run's rows ``rows`` (N, C) of linear module ``name`` beside its float input rows."""
    xf = _recorded(partner, name)
    xf = xf.reshape(-1, xf.shape[-1])
    if xf.shape != rows.shape:
        raise ValueError(f"{name}: float input rows {tuple(xf.shape)} do not pair with the run's {tuple(rows.shape)}")
    return torch.cat([rows, xf.to(rows.dtype)], dim=-1)


def expert_pairs(partner, module, name: str, x: torch.Tensor, h: torch.Tensor, tok: torch.Tensor,
                 counts: list) -> tuple:
    """(gate/up pairs (R, 2H), down pairs (sum(counts), 2I)): the run's routed rows ``x`` (R, H) (token ids
    ``tok``, sorted by expert, ``counts[e]`` each) and down rows ``h``, beside the float ones."""
    xf_all = _recorded(partner, name)
    xf = xf_all[tok].to(x.dtype)
    hf = down_inputs(module, xf, counts).to(h.dtype)
    return torch.cat([x, xf], dim=-1), torch.cat([h, hf], dim=-1)
