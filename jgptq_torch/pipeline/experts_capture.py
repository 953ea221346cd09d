"""The ``"jgptq_capture"`` experts implementation: an experts forward for transformers' ``ExpertsInterface`` that
computes the layer output like the eager loop and hands each expert's inputs to the active collector
(:class:`jgptq_torch.pipeline.capture.Collector`).

It computes the output for every flag combination of ``use_experts_implementation`` (concatenated or interleaved
gate/up, transposed storage, biases, ungated experts, post-expert norm), with float32 accumulation of the weighted
expert outputs as ``grouped_mm`` does, and gives the collector each expert's gate/up input rows and down input rows
(the activated ``act(gate) * up``). On accelerators the routed experts run as two grouped matrix products (torch's
``grouped_mm``) instead of a loop over experts (:func:`_grouped_on`). :func:`experts_implementation` selects it on
a model for the duration of a block.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from jgptq_torch import models
from jgptq_torch.models import ExpertsLayout, UnsupportedModelError, flag
from jgptq_torch.pipeline.active_collector import ACTIVE
from jgptq_torch.pipeline.prescaled_capture import prescaled_capture
from jgptq_torch.pipeline.row_capture import row_capture
from jgptq_torch.pipeline.stacked_capture import stacked_capture

IMPLEMENTATION = "jgptq_capture"


def _activate(module, y: torch.Tensor) -> torch.Tensor:
    """The expert's activation of its up projection ``y``: the gate (gated experts) or ``act_fn``."""
    if not flag(module, "has_gate"):
        return module.act_fn(y)
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:  # transformers releases before ``_apply_gate``: concatenated [gate; up]
        g, u = y.chunk(2, dim=-1)
        return module.act_fn(g) * u
    return apply_gate(y)


def _up_projection(module, lay: ExpertsLayout, x: torch.Tensor, e: int) -> torch.Tensor:
    name = lay.up_name
    w = getattr(module, name)[e]
    y = x @ w if flag(module, "is_transposed") else F.linear(x, w)
    if flag(module, "has_bias"):
        y = y + getattr(module, name + "_bias")[e]
    return _activate(module, y)


def _finish_down(module, o: torch.Tensor) -> torch.Tensor:
    if flag(module, "has_post_expert_norm"):
        o = module.post_expert_norm(o)
    return o


def _down_projection(module, h: torch.Tensor, e: int) -> torch.Tensor:
    w = module.down_proj[e]
    o = h @ w if flag(module, "is_transposed") else F.linear(h, w)
    if flag(module, "has_bias"):
        o = o + module.down_proj_bias[e]
    return _finish_down(module, o)


def _grouped_mm():
    """torch's grouped matrix product (``torch.nn.functional.grouped_mm``, or ``torch._grouped_mm`` before it was
    public), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the routed experts run as two grouped matrix products (one kernel per projection for all experts)
    instead of a loop over experts: for bfloat16 on CUDA devices of compute capability 8.0 or more (what torch's
    grouped kernels take), where the loop's hundreds of small kernels per forward cost more than their arithmetic.
    The CPU keeps the loop."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and _grouped_mm() is not None
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _grouped_linear(module, x: torch.Tensor, name: str, offsets: torch.Tensor, expert: torch.Tensor):
    """Rows ``x`` (R, C) sorted by expert, ``offsets`` (E,) int32 ends of each expert's rows: every expert's rows
    times its matrix ``name``, plus its bias."""
    w = getattr(module, name)
    w = w if flag(module, "is_transposed") else w.transpose(-2, -1)
    y = _grouped_mm()(x.to(w.dtype), w, offs=offsets)
    if flag(module, "has_bias"):
        y = y + getattr(module, name + "_bias")[expert]
    return y


def down_inputs(module, x: torch.Tensor, counts: list) -> torch.Tensor:
    """The down projections' inputs of rows ``x`` sorted by expert (``counts[e]`` rows each; rows past their sum
    are left out): each expert's activated up projection of its rows, computed as the forward computes it (grouped
    products where :func:`_grouped_on`, else a loop). Returns (sum(counts), I)."""
    lay = ExpertsLayout.of(module)
    routed = sum(counts)
    x = x[:routed]
    if _grouped_on(x.device, x.dtype):
        count_t = torch.as_tensor(counts, device=x.device)
        offsets = torch.cumsum(count_t, 0, dtype=torch.int32)
        expert = None
        if flag(module, "has_bias"):
            expert = torch.repeat_interleave(torch.arange(count_t.numel(), device=x.device), count_t)
        return _activate(module, _grouped_linear(module, x, lay.up_name, offsets, expert))
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            parts.append(_up_projection(module, lay, x[start:start + n], e))
        start += n
    return torch.cat(parts)


def _grouped_experts(module, lay: ExpertsLayout, x: torch.Tensor, count_t: torch.Tensor):
    """All routed experts at once: rows ``x`` (R, H) sorted by expert, ``count_t`` (E,) rows per expert.

    Returns:
      (h, o): the down projections' inputs (R, I) and the experts' outputs (R, H), row for row.
    """
    offsets = torch.cumsum(count_t, 0, dtype=torch.int32)
    expert = None
    if flag(module, "has_bias"):
        expert = torch.repeat_interleave(torch.arange(count_t.numel(), device=x.device), count_t)
    h = _activate(module, _grouped_linear(module, x, lay.up_name, offsets, expert))
    o = _finish_down(module, _grouped_linear(module, h, "down_proj", offsets, expert))
    return h, o


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """An experts forward for transformers' ``ExpertsInterface`` that reports each expert's inputs.

    Args:
      hidden_states: (T, H) tokens (padding included).
      top_k_index: (T, k) int64 expert ids (ids >= num_experts are expert-parallel sentinels and are dropped).
      top_k_weights: (T, k) routing weights.
    Returns:
      (T, H) in the dtype of ``hidden_states``: sum over the k routed experts of weight * expert(x).
    """
    collector = ACTIVE.get()
    if collector is not None:
        collector.experts_input(self, hidden_states)
    every = collector is not None and collector.all_experts
    lay = ExpertsLayout.of(self)
    n_exp = int(self.num_experts)
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    count_t = torch.bincount(flat, minlength=n_exp)[:n_exp]
    counts = count_t.tolist()
    if not every and _grouped_on(hidden_states.device, hidden_states.dtype):
        return _grouped_forward(self, lay, collector, hidden_states, top_k_weights, order, count_t, counts, k)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    routed = collector is not None and not every
    down_inputs = []  # routed mode: each expert's down-projection input, in expert order
    start = 0
    for e in range(n_exp):
        sel = order[start:start + counts[e]]
        start += counts[e]
        if counts[e] == 0 and not every:
            continue
        tok, slot = sel // k, sel % k
        if every:
            # Hessians from every token; the output below is recomputed from the routed rows alone, so that it
            # is bit-identical to routed calibration (matmul blocking depends on the row count).
            h = _up_projection(self, lay, hidden_states, e) if collector.sees(self, e) else None
            collector.expert_inputs(self, e, hidden_states, h, tok)
            if counts[e] == 0:
                continue
        x = hidden_states[tok]
        h = _up_projection(self, lay, x, e)
        if routed:
            down_inputs.append(h)
        o = _down_projection(self, h, e)
        out.index_add_(0, tok, (o * top_k_weights[tok, slot, None]).float())
    if routed and down_inputs:
        tok = order // k
        collector.routed_inputs(self, hidden_states[tok], torch.cat(down_inputs), tok, counts,
                                top_k_weights.reshape(-1)[order])
    return out.to(hidden_states.dtype)


def _grouped_forward(module, lay, collector, hidden_states, top_k_weights, order, count_t, counts, k):
    """:func:`experts_forward` with grouped matrix products (see :func:`_grouped_on`); the k weighted outputs of a
    token are summed in float32 in a fixed order (no atomics: the same bytes on every run)."""
    routed = sum(counts)                       # expert-parallel sentinels sort last and are dropped
    sel = order[:routed]
    tok, slot = sel // k, sel % k
    x = hidden_states[tok]
    h, o = _grouped_experts(module, lay, x, count_t)
    if collector is not None and routed:
        collector.routed_inputs(module, x, h, tok, counts, top_k_weights.reshape(-1)[sel])
    product = o * top_k_weights[tok, slot, None]
    # each (token, slot) pair's row of ``product``: a gather through the inverse of ``order`` (a scatter into a
    # zeroed buffer wrote every row twice)
    pairs = order.numel()
    where = torch.empty_like(order)
    where[order] = torch.arange(pairs, device=order.device)
    if routed < pairs:                          # sentinel pairs read a zero row
        product = torch.cat([product, product.new_zeros((1, product.shape[-1]))])
        where.clamp_(max=routed)
    out = product[where].view(-1, k, o.shape[-1]).sum(dim=1, dtype=torch.float32)
    return out.to(hidden_states.dtype)


def _register():
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


@contextlib.contextmanager
def experts_implementation(model):
    """Selects the capture implementation on ``model`` for the duration of the block, then restores the previous
    choice (nothing to select for a model without dispatchable experts). Experts that transformers does not
    dispatch report their routed inputs for the same block: those of :data:`jgptq_torch.models.PRESCALED_EXPERTS`
    through :func:`jgptq_torch.pipeline.prescaled_capture.prescaled_capture`, experts stacks
    (:data:`jgptq_torch.models.STACKED_EXPERTS`) through
    :func:`jgptq_torch.pipeline.stacked_capture.stacked_capture`, experts kept as blocks of rows
    (:data:`jgptq_torch.row_experts.ROW_EXPERTS`) through :func:`jgptq_torch.pipeline.row_capture.row_capture`."""
    kinds = {models.is_prescaled(m) for m in model.modules() if models.is_experts_module(m)}
    with contextlib.ExitStack() as undispatched:
        undispatched.enter_context(stacked_capture(model))
        undispatched.enter_context(row_capture(model))
        if True in kinds:
            undispatched.enter_context(prescaled_capture(model))
        if False not in kinds:                # nothing for transformers' experts interface to dispatch
            yield
            return
        if not hasattr(model, "set_experts_implementation"):
            raise UnsupportedModelError(f"{type(model).__name__} has fused experts but no set_experts_implementation; "
                                        f"a transformers release with the experts interface is needed")
        _register()
        getter = getattr(model, "get_experts_implementation", None)
        previous = getter() if getter is not None else getattr(model.config, "_experts_implementation", None)
        model.set_experts_implementation(IMPLEMENTATION)
        try:
            yield
        finally:
            if previous is not None and previous != {"": None}:
                model.set_experts_implementation(previous)
