"""Each expert's routed inputs for experts that transformers does not dispatch through its experts interface
(:data:`jgptq_torch.models.PRESCALED_EXPERTS`: Llama 4's ``Llama4TextExperts``).

Llama 4's MoE block multiplies every token's hidden state by its routing score for each expert (a sigmoid of the
router logit on the token's top-k experts, exactly 0 elsewhere) and hands the experts all E·T rows at once; the
experts run them as two batched products, ``x (E, T, H) @ gate_up_proj`` and ``act(gate)·up (E, T, I) @
down_proj``. The layer's own forward runs unchanged: a torch function mode records the left operands of those two
products (the very tensors the experts multiply), and a forward hook on the block's router gives the token's top-k
experts (``torch.topk`` of the router logits, as the router itself computes it). The routed rows of the recorded
operands go to the active :class:`jgptq_torch.pipeline.capture.Collector` like those of a dispatched experts
module: an expert's gate/up statistics are over its routed tokens' pre-scaled hidden states (score·x), its down
statistics over what its down projection really multiplies. Unrouted rows (all zero) are not counted.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from jgptq_torch import models
from jgptq_torch.pipeline.active_collector import ACTIVE

_PRODUCTS = (torch.bmm, torch.matmul, torch.Tensor.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _LeftOperands(TorchFunctionMode):
    """Inside the block, records the left operand of every matrix product whose right operand is one of the
    given parameters (``id(parameter) -> label``): ``seen[label]`` is the last such operand."""

    def __init__(self, weights: dict):
        super().__init__()
        self.weights, self.seen = weights, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and len(args) >= 2 and id(args[1]) in self.weights:
            self.seen[self.weights[id(args[1])]] = args[0]
        return func(*args, **(kwargs or {}))


def _router_of(parent: torch.nn.Module, name: str, experts: torch.nn.Module) -> torch.nn.Module:
    attr = models.PRESCALED_EXPERTS[type(experts).__name__]["router"]
    router = getattr(parent, attr, None)
    if router is None or not hasattr(router, "top_k"):
        raise models.UnsupportedModelError(
            f"{name} ({type(experts).__name__}): its block {type(parent).__name__} has no router {attr!r} with a "
            f"top_k; the routed rows of its experts cannot be told from the unrouted ones")
    return router


def _routed_forward(module: torch.nn.Module, name: str, pending: dict):
    """The experts' own forward, which also hands the routed rows of its two products to the active collector."""
    original = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        collector = ACTIVE.get()
        top_k = pending.pop(id(module), None)
        if collector is None or id(module) not in getattr(collector, "_module_names", {}):
            return original(module, hidden_states)
        if collector.all_experts:
            raise models.UnsupportedModelError(
                f"{name} ({type(module).__name__}): all-experts calibration is not defined for experts whose "
                f"inputs are pre-scaled by the routing score (an unrouted token reaches them multiplied by 0); "
                f"calibrate with the routed tokens (moe calibration 'routed')")
        if top_k is None:
            raise RuntimeError(f"{name}: its router did not run before it in this forward; the routed rows of its "
                               f"inputs are unknown")
        with _LeftOperands({id(module.gate_up_proj): "gate_up", id(module.down_proj): "down"}) as ops:
            out = original(module, hidden_states)
        if set(ops.seen) != {"gate_up", "down"}:
            raise models.UnsupportedModelError(
                f"{name} ({type(module).__name__}): its forward did not multiply its inputs by gate_up_proj and "
                f"down_proj as matrix products (saw {sorted(ops.seen)}); this transformers release computes it "
                f"differently and its inputs cannot be read")
        x3, h3 = ops.seen["gate_up"], ops.seen["down"]           # (E, T, H) pre-scaled rows, (E, T, I)
        n_exp, tokens = x3.shape[0], x3.shape[1]
        if top_k.shape[0] != tokens or h3.shape[:2] != x3.shape[:2]:
            raise RuntimeError(f"{name}: {top_k.shape[0]} routed tokens from the router but operands "
                               f"{tuple(x3.shape)} and {tuple(h3.shape)} in the experts")
        k = top_k.shape[1]
        flat = top_k.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_exp)[:n_exp].tolist()
        tok, expert = order // k, flat[order]
        collector.routed_inputs(module, x3[expert, tok], h3[expert, tok], tok, counts)
        return out

    return forward


@contextlib.contextmanager
def prescaled_capture(model: torch.nn.Module):
    """For the duration of the block, every experts module of ``model`` of a class in
    :data:`jgptq_torch.models.PRESCALED_EXPERTS` hands its routed rows to the active collector (its output is its
    own forward's, unchanged). A no-op for a model without such modules."""
    pending, handles, patched = {}, [], []

    def remember(experts):
        def hook(router, args, output):
            logits = output[1] if isinstance(output, tuple) else output
            pending[id(experts)] = torch.topk(logits, router.top_k, dim=1).indices
        return hook

    try:
        for parent_name, parent in model.named_modules():
            for child_name, child in parent.named_children():
                if not models.is_prescaled(child):
                    continue
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                router = _router_of(parent, name, child)
                handles.append(router.register_forward_hook(remember(child)))
                child.forward = _routed_forward(child, name, pending)
                patched.append(child)
        yield
    finally:
        for h in handles:
            h.remove()
        for child in patched:
            child.__dict__.pop("forward", None)
        pending.clear()
