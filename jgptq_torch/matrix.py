"""What a decoder layer's walkers share: :class:`Matrix`, one quantization target, and
:class:`UnsupportedModelError`. :mod:`jgptq_torch.models` finds the targets; the layouts that describe a fused
experts parameter (:class:`jgptq_torch.models.ExpertsLayout`, ``StackLayout``,
:class:`jgptq_torch.row_experts.RowsLayout`) live beside the modules they read."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The model's module layout is one jgptq cannot quantize faithfully."""


@dataclasses.dataclass(frozen=True, eq=False)
class Matrix:
    """One quantization target of a decoder layer, as every walker of a layer sees it: a linear module's weight,
    or one fused parameter of an experts module (a stack of E matrices).

    Attributes:
      name: relative to the decoder layer: ``self_attn.q_proj`` (a linear module), ``mlp.experts.down_proj`` or
        ``mlp.input_linear.weight`` (a stack).
      kind: ``"linear"``, ``"expert_gate_up"``, ``"expert_down"`` or ``"expert_stack"``.
      rows, cols: one matrix's (out, in) shape in nn.Linear orientation.
      experts: E for a fused experts parameter, None for a linear module.
      transposed: the parameter is stored (E, in, out).
      module_name: the module holding it (``self_attn.q_proj``, ``mlp.experts``).
      hessian_key: the capture's key of its Hessian (a linear's module name, or (experts module, ``"gate_up"``,
        ``"down"`` or ``"weight"``)).
      module: the nn.Linear or the experts module; layout: the experts' :class:`ExpertsLayout` or
        :class:`StackLayout` (None for linear).
    """

    name: str
    kind: str
    rows: int
    cols: int
    experts: "int | None"
    transposed: bool
    module_name: str
    hessian_key: object
    module: nn.Module
    layout: "ExpertsLayout | None" = None

    @property
    def count(self) -> int:
        """Matrices in the stack: E, or 1 for a linear module."""
        return self.experts or 1

    @property
    def parameter(self) -> nn.Parameter:
        """The torch parameter that holds it."""
        if self.layout is None:
            return self.module.weight
        return getattr(self.module, self.name.rsplit(".", 1)[1])

    def param_name(self, base: str) -> str:
        """The model parameter name under the decoder layer ``base`` (``model.layers.3``)."""
        return f"{base}.{self.name}.weight" if self.layout is None else f"{base}.{self.name}"

    def weight(self) -> torch.Tensor:
        """The (count, rows, cols) nn.Linear-orientation view of the parameter (no copy)."""
        p = self.parameter.detach()
        return p[None] if self.layout is None else self.layout.linear(p)
