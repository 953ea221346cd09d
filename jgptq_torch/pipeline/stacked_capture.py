"""Each expert's routed input rows for experts stacks that are modules of their own
(:data:`jgptq_torch.models.STACKED_EXPERTS`: JetMoe's ``JetMoeParallelExperts``).

Such a stack holds one 3-D ``weight`` (E, out, in); its forward is given the rows of every expert at once, sorted by
expert, and ``expert_size``, the rows of each (expert ``e`` multiplies rows ``sum(size[:e]) ..`` by ``weight[e]``).
JetMoe's MLP block hands its ``input_linear`` (gate and up, concatenated) the routed tokens' hidden states and its
``output_linear`` the activated ``act(gate) * up``; its attention mixture hands ``input_linear`` (the query
projection) the routed tokens' hidden states and ``output_linear`` each routed (token, expert) pair's attention
output. The layer's forward runs unchanged: a forward pre-hook on each stack reads the very rows and sizes its
forward receives, and a forward hook on the block's router (:class:`Routing`) gives the token and routing weight of
every sorted row (the same sort serves both stacks of a block). The rows go to the active
:class:`jgptq_torch.pipeline.capture.Collector` (:meth:`~jgptq_torch.pipeline.capture.Collector.stack_inputs`), so an
expert's Hessian is over exactly the rows its matrix multiplies; padding tokens are left out by their token ids.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from jgptq_torch import models
from jgptq_torch.pipeline.active_collector import ACTIVE


class Routing:
    """The last routing of every block that holds experts stacks: a forward hook on each block's router
    (:data:`jgptq_torch.models.STACKED_EXPERTS` names it and the places of its outputs)."""

    def __init__(self):
        self.last: dict = {}      # id(block) -> (tokens (R,), weights (R,), sizes [E])
        self.handles: list = []
        self._blocks: dict = {}   # id(stack) -> (block, stack name)

    def watch(self, block: torch.nn.Module, name: str, stack: torch.nn.Module) -> None:
        """Follows the router of ``block``, the parent of experts stack ``stack`` (named ``name``)."""
        facts = models.STACKED_EXPERTS[type(stack).__name__]
        self._blocks[id(stack)] = (block, name)
        if id(block) in self.last:           # the block's other stack: its router is followed already
            return
        router = getattr(block, facts["router"], None)
        if router is None:
            raise models.UnsupportedModelError(
                f"{name} ({type(stack).__name__}): its block {type(block).__name__} has no router "
                f"{facts['router']!r}; the tokens of its sorted rows cannot be known")
        self.last[id(block)] = None

        def hook(module, args, output):
            self.last[id(block)] = (output[facts["tokens"]], output[facts["weights"]], list(output[facts["sizes"]]))
        self.handles.append(router.register_forward_hook(hook))

    def rows(self, stack: torch.nn.Module, x: torch.Tensor, sizes) -> tuple:
        """(token ids (R,), routing weights (R,), rows per expert [E]) of the rows ``x`` (R, C) that ``stack`` is
        given with ``sizes``, from its block's last routing (checked to be the one that sorted them)."""
        block, name = self._blocks[id(stack)]
        got = self.last.get(id(block))
        sizes = [int(n) for n in sizes]
        if got is None or got[2] != sizes or got[0].shape[0] != x.shape[0]:
            raise RuntimeError(f"{name}: its {x.shape[0]} rows and rows per expert {sizes} are not those its "
                               f"block's router last sorted; the tokens of its rows are unknown")
        return got

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.last.clear()


def stack_arguments(stack: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """(rows (R, C), rows per expert) of a call of ``stack``'s forward with ``args`` / ``kwargs`` (its first two
    parameters, however they were passed)."""
    bound = inspect.signature(stack.forward).bind(*args, **kwargs)
    values = list(bound.arguments.values())
    return values[0], values[1]


def stacks_of(model: torch.nn.Module) -> list:
    """[(qualified name, parent block, stack)] of every experts stack of ``model``."""
    out = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if models.is_stacked(child):
                out.append((f"{parent_name}.{child_name}" if parent_name else child_name, parent, child))
    return out


@contextlib.contextmanager
def stacked_capture(model: torch.nn.Module):
    """For the duration of the block, every experts stack of ``model`` hands the rows its forward is given to the
    active collector (its output is its own forward's, unchanged). A no-op for a model without such stacks.

    Raises (in a forward):
      UnsupportedModelError: a collector that sees every token at every expert (``all_experts``): an expert's
        rows exist only for the tokens routed to it (the attention mixture's output projection is given each
        routed pair's attention output).
    """
    routing, handles = Routing(), []

    def feed(name):
        def hook(stack, args, kwargs):
            collector = ACTIVE.get()
            if collector is None or id(stack) not in getattr(collector, "_module_names", {}):
                return
            if collector.all_experts:
                raise models.UnsupportedModelError(
                    f"{name} ({type(stack).__name__}): all-experts calibration is not defined for experts stacks "
                    f"given only their routed rows; calibrate with the routed tokens (moe calibration 'routed')")
            x, sizes = stack_arguments(stack, args, kwargs)
            tok, weights, counts = routing.rows(stack, x, sizes)
            collector.stack_inputs(stack, x.reshape(-1, x.shape[-1]), tok, counts, weights)
        return hook

    try:
        for name, parent, stack in stacks_of(model):
            routing.watch(parent, name, stack)
            handles.append(stack.register_forward_pre_hook(feed(name), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        routing.close()
