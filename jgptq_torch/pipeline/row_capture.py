"""Each expert's routed inputs for experts kept as blocks of rows of 2-D parameters (:mod:`jgptq_torch.row_experts`:
DBRX's ``DbrxExperts``).

The experts module is called with the hidden states (T, H) (any leading shape), each token's top-k experts and their
routing weights, and runs its own loop: expert ``e`` multiplies the tokens routed to it by its gate and up blocks,
and ``act(gate)·up`` by its down block. The layer's forward runs unchanged: a forward pre-hook on the experts module
reads the very arguments it is given, selects each expert's tokens as its loop does (the (slot, token) pairs of
the one-hot routing mask) and computes its down input with the module's own activation and products; the rows go
to the active :class:`jgptq_torch.pipeline.capture.Collector` like those of a dispatched experts module
(:meth:`~jgptq_torch.pipeline.capture.Collector.routed_inputs`, or
:meth:`~jgptq_torch.pipeline.capture.Collector.expert_inputs` for a statistic that sees every token). The down
inputs are computed once more beside the module's loop: the cost is one more pass of the experts' products.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from jgptq_torch.pipeline.active_collector import ACTIVE
from jgptq_torch.row_experts import RowsLayout, is_row_experts


def _arguments(module, args: tuple, kwargs: dict) -> tuple:
    """(hidden states (T, H), top-k expert ids (T, k), routing weights (T, k)) of a call of ``module``'s forward."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    hidden, index, weights = list(bound.arguments.values())[:3]
    return hidden.reshape(-1, hidden.shape[-1]), index.reshape(hidden.shape[:-1].numel(), -1), \
        weights.reshape(hidden.shape[:-1].numel(), -1)


def _feed(collector, module, layout: RowsLayout, hidden, index, weights) -> None:
    act = getattr(module, layout.holder).activation_fn
    gate, up, _ = layout.weights(module)
    n = layout.num_experts
    mask = torch.nn.functional.one_hot(index, num_classes=n + 1).permute(2, 1, 0)   # (E + 1, k, T)

    def down_input(x, e):
        return act(x @ gate[e].T) * (x @ up[e].T)

    if collector.all_experts:
        for e in range(n):
            _, tok = torch.where(mask[e])
            h = down_input(hidden, e) if collector.sees(module, e) else None
            collector.expert_inputs(module, e, hidden, h, tok)
        return
    xs, hs, toks, ws, counts = [], [], [], [], []
    for e in range(n):
        slot, tok = torch.where(mask[e])
        x = hidden[tok]
        xs.append(x)
        hs.append(down_input(x, e))
        toks.append(tok)
        ws.append(weights[tok, slot])
        counts.append(int(tok.numel()))
    collector.routed_inputs(module, torch.cat(xs), torch.cat(hs), torch.cat(toks), counts, torch.cat(ws))


@contextlib.contextmanager
def row_capture(model: torch.nn.Module):
    """For the duration of the block, every experts module of :data:`jgptq_torch.row_experts.ROW_EXPERTS` in
    ``model`` hands its experts' inputs to the active collector (its output is its own forward's, unchanged). A
    no-op for a model without such modules."""
    handles = []

    def hook(module, args, kwargs):
        collector = ACTIVE.get()
        if collector is None or id(module) not in getattr(collector, "_module_names", {}):
            return
        with torch.no_grad():
            _feed(collector, module, RowsLayout.of(module), *_arguments(module, args, kwargs))

    try:
        for module in model.modules():
            if is_row_experts(module):
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
