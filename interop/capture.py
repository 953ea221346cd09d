"""Seeing the inputs of every weight of a decoder layer, and feeding them to a chain of statistics (JAX, via DLPack).

The statistics are pairs of pure functions (:mod:`jgptq.statistics`: the Hessian sum, the importance statistic);
:class:`Collector` applies each to every input it sees. Two mechanisms, both active only inside
:meth:`Collector.attach`:

- forward hooks on ``nn.Linear`` modules: a module's input rows feed its statistics. Modules that receive the very
  same input tensor object in one forward (q/k/v after the input norm, gate/up after the post-attention norm,
  a shared expert's gate/up) share one state: the tie is observed, not listed per model;
- the ``"jgptq_capture"`` experts implementation, registered with transformers' ``ExpertsInterface`` and selected
  with ``model.set_experts_implementation`` (see :func:`experts_implementation`). It computes the layer output like
  the eager loop (float32 accumulation of the weighted expert outputs, as ``grouped_mm`` does) for every flag
  combination of ``use_experts_implementation`` (concatenated or interleaved gate/up, transposed storage, biases,
  ungated experts, post-expert norm), and hands each expert's gate/up input rows and down input rows (the
  activated ``act(gate) * up``) to the active :class:`Collector`. On accelerators the routed experts run as two
  grouped matrix products (torch's ``grouped_mm``) instead of a loop over experts (:func:`_grouped_on`).

Calibration modes: ``routed`` (an expert sees the tokens the router sends it) and ``all_experts`` (a statistic made
with ``all_experts``, the Hessian in that mode, sees every token at its gate/up and down inputs; the output still
uses the routed rows only, so it is exactly the routed output; gate/up of all experts then share one state).
Padding tokens (attention mask 0) never reach a statistic.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from interop.dlpack import to_jax
from interop.models import ExpertsLayout, UnsupportedModelError, flag
from jgptq import statistics as stats

IMPLEMENTATION = "jgptq_capture"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jgptq_collector", default=None)
_MAX_ROWS = 1 << 13
_GROUP_BYTES = 1 << 30  # padded rows of one group of experts passed to the accumulation at once


def _bucket(n: int) -> int:
    """Rows a batch of ``n`` rows is padded to: a power of two from 64 to 8192, so that the jitted accumulation
    compiles for a handful of shapes only (padding rows are zero and masked out of the token count)."""
    return max(64, 1 << (max(n, 1) - 1).bit_length())


def _fixed_group_sizes(device: torch.device) -> bool:
    """Whether a group of routed experts is always padded to the most slots of its row bucket.

    Each distinct (slots, rows, columns) shape of a group compiles one accumulation program. Padded to a power of
    two of its members, a group takes many shapes as routing loads vary from batch to batch and layer to layer: a
    simulated 48-layer, 128-expert run (skewed loads, 8 batches of 262,144 routed rows per layer) compiled 44
    programs, against 16 with one group size per bucket. On an accelerator a compile costs seconds and the padded
    slots (empty, masked) cost little, so groups there are padded to the bucket's most slots; on CPU, where the
    arithmetic dominates, only to the next power of two of the members.
    """
    return device.type != "cpu"


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
    collector = _ACTIVE.get()
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
            collector.expert_inputs(self, e, hidden_states, _up_projection(self, lay, hidden_states, e), tok)
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
        collector.routed_inputs(self, hidden_states[tok], torch.cat(down_inputs), tok, counts)
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
        collector.routed_inputs(module, x, h, tok, counts)
    product = o * top_k_weights[tok, slot, None]
    weighted = torch.zeros((order.numel(), o.shape[-1]), dtype=product.dtype, device=o.device)
    weighted[sel] = product
    out = weighted.view(-1, k, o.shape[-1]).sum(dim=1, dtype=torch.float32)
    return out.to(hidden_states.dtype)


def _register():
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


@contextlib.contextmanager
def experts_implementation(model):
    """Selects the capture implementation on ``model`` for the duration of the block, then restores the previous
    choice (a no-op for a model without dispatchable experts)."""
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


class Collector:
    """Statistics of one decoder layer's target inputs, fed by hooks and the capture implementation.

    The collector is given a chain of statistics (name -> :class:`jgptq.statistics.Statistic`) and applies each,
    in order, to every input row it sees; what they compute is theirs. Padding tokens are masked out.

    Keys: a linear module's key is the name of the first module that received the same input tensor (its tie
    leader); experts modules have stacked states ``(name, "gate_up")`` and ``(name, "down")`` with one entry per
    expert (``(name, "gate_up")`` is a single state for a statistic that sees every token, ``all_experts``).

    Args:
      linears: relative name -> nn.Linear.
      experts: relative name -> (module, :class:`interop.models.ExpertsLayout`).
      statistics: name -> :class:`jgptq.statistics.Statistic` (default :func:`jgptq.statistics.calibration`: the
        float32 Hessian sum and the importance statistic).
    """

    def __init__(self, linears: dict, experts: dict, statistics: dict = None):
        self.linears, self.experts = linears, experts
        self.statistics = dict(stats.calibration() if statistics is None else statistics)
        self.states_of = {name: {} for name in self.statistics}   # statistic name -> key -> state
        self.tie: dict = {}                       # linear name -> state key
        self.routed = {name: [0] * lay.num_experts for name, (_, lay) in experts.items()}
        self.batch_tokens = 0                     # non-padding tokens seen
        self._module_names = {id(m): n for n, (m, _) in experts.items()}
        self._seen: list = []
        self._keep = None
        self._keep_count = None
        self._handles: list = []

    @property
    def all_experts(self) -> bool:
        """Whether a statistic sees every token of every expert (the experts' forward then runs each expert on
        every token, and the routed rows of the output are computed apart)."""
        return any(s.all_experts for s in self.statistics.values())

    @property
    def states(self) -> dict:
        """key -> state of the Hessian statistic (``"hessian"``; empty without one)."""
        return self.states_of.get(stats.HESSIAN, {})

    # -- lifecycle -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self):
        """Hooks the linear modules and makes this collector the experts implementation's target."""
        for name, module in self.linears.items():
            self._handles.append(module.register_forward_hook(self._linear_hook(name)))
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._seen.clear()

    @contextlib.contextmanager
    def batch(self, keep: torch.Tensor):
        """Marks one calibration forward; ``keep`` is the (B, S) attention mask (nonzero = real token)."""
        keep = keep.reshape(-1).to(torch.bool)
        n = int(keep.sum())
        self._keep = None if n == keep.numel() else keep
        self._keep_count = keep.numel()
        self.batch_tokens += n
        try:
            yield
        finally:
            self._seen.clear()
            self._keep = None

    # -- accumulation ----------------------------------------------------------------------------------------
    def _rows_keep(self, rows: int, what: str):
        if self._keep is None:
            return None
        if rows != self._keep_count:
            raise ValueError(f"{what}: {rows} input rows cannot be aligned with the {self._keep_count} tokens of "
                             f"the attention mask; padding could not be excluded")
        return self._keep

    def _chain(self, all_experts=None) -> list:
        """(name, statistic) of the chain, in order; only those whose ``all_experts`` is the given one, if any."""
        return [(n, s) for n, s in self.statistics.items() if all_experts is None or s.all_experts == all_experts]

    def _add(self, key, x: torch.Tensor, keep, index=None, size=None, name="activations", chain=None):
        """Adds rows of x (N, C) where keep (N,) holds (None: all rows) to the states ``key`` of the statistics of
        ``chain`` (default: all): entry ``index`` of stacks of ``size`` entries, or a single state (None)."""
        chain = self._chain() if chain is None else chain
        if not chain:
            return
        if keep is not None:
            x = x[keep]
        n = x.shape[0]
        states = [self.states_of[s].get(key) for s, _ in chain]
        for start in range(0, max(n, 1), _MAX_ROWS):
            piece = x[start:start + _MAX_ROWS]
            m = piece.shape[0]
            if m == 0 and all(state is not None for state in states):
                break
            p = _bucket(m)
            padded = F.pad(piece, (0, 0, 0, p - m)) if p != m else piece
            mask = torch.arange(p, device=piece.device) < m
            xj, mj = to_jax(padded, name=name), to_jax(mask, name=name + " mask")
            for j, (_, statistic) in enumerate(chain):
                if states[j] is None:
                    states[j] = statistic.init(x.shape[-1], size, next(iter(xj.devices())))
                if m:
                    states[j] = statistic.update(states[j], xj, mj, index, name=name)
        for (s, _), state in zip(chain, states):
            self.states_of[s][key] = state


    def _linear_hook(self, name):
        def hook(module, args, output):
            x = args[0]
            for seen, key in self._seen:
                if seen is x:
                    break
            else:
                key = None
            if key is None:
                key = name
                self._seen.append((x, key))
                rows = x.reshape(-1, x.shape[-1])
                self._add(key, rows, self._rows_keep(rows.shape[0], name), name=name)
            if self.tie.setdefault(name, key) != key:
                raise RuntimeError(f"{name}: shares its input with {key!r} in one forward but with "
                                   f"{self.tie[name]!r} in another; the layer's data flow is not static")
        return hook

    def expert_inputs(self, module, e: int, x: torch.Tensor, h: torch.Tensor, tok: torch.Tensor):
        """Called by :func:`experts_forward` for expert ``e`` when a statistic sees every token
        (:attr:`all_experts`): gate/up input rows x and down input rows h of every token, and the routed token ids
        ``tok``. Statistics of every token get all rows (gate/up: one state shared by the experts); the others get
        the routed rows."""
        name = self._module_names.get(id(module))
        if name is None:
            return
        lay = self.experts[name][1]
        keep = self._keep
        routed_keep = None if keep is None else keep[tok]
        self.routed[name][e] += int(tok.numel() if routed_keep is None else routed_keep.sum())
        every = self._chain(all_experts=True)
        if e == 0:
            self._add((name, "gate_up"), x, self._rows_keep(x.shape[0], name), name=f"{name} gate/up", chain=every)
        self._add((name, "down"), h, self._rows_keep(h.shape[0], name), index=e, size=lay.num_experts,
                  name=f"{name} down", chain=every)
        for part, rows in (("gate_up", x), ("down", h)):
            self._add((name, part), rows[tok], routed_keep, index=e, size=lay.num_experts, name=f"{name} {part}",
                      chain=self._chain(all_experts=False))

    def routed_inputs(self, module, x: torch.Tensor, h: torch.Tensor, tok: torch.Tensor, counts: list):
        """Called once per forward by :func:`experts_forward` in routed mode with every expert's rows at once:
        gate/up inputs x (R, H) and down inputs h (R, I) sorted by expert (``counts[e]`` rows each), and their
        token ids ``tok`` (R,). Experts are accumulated in groups (a few calls per forward, not one per expert)."""
        name = self._module_names.get(id(module))
        if name is None:
            return
        n_exp = self.experts[name][1].num_experts
        keep = None if self._keep is None else self._keep[tok]
        real = list(counts)
        if keep is not None:
            count_t = torch.as_tensor(counts, device=x.device)
            expert = torch.repeat_interleave(torch.arange(n_exp, device=x.device), count_t)
            real = torch.zeros(n_exp, dtype=torch.long, device=x.device).index_add_(0, expert, keep.long()).tolist()
        for e, n in enumerate(real):
            self.routed[name][e] += n
        for part, rows in (("gate_up", x), ("down", h)):
            self._add_grouped((name, part), rows, counts, keep, n_exp,
                              f"{name} {'gate/up' if part == 'gate_up' else part}")

    def _add_grouped(self, key, rows, counts: list, keep, n_exp: int, name: str):
        """Experts with a similar number of rows (the same power-of-two bucket) are padded to that bucket and
        added together, a group of at most ``_GROUP_BYTES`` (a power of two of experts) per call; an expert with
        more than ``_MAX_ROWS`` rows is added in passes of ``_MAX_ROWS``. See :func:`_fixed_group_sizes` for the
        number of slots of a group.

        ``rows`` are sorted by expert (``counts[e]`` each). A group's padded block is one gather of ``rows`` at
        computed positions (padding positions read any row and are masked out), so that packing needs no
        device synchronization beyond one small copy of the group layout per call."""
        c, dev = rows.shape[-1], rows.device
        fixed = _fixed_group_sizes(dev)
        cap = 1 << (n_exp - 1).bit_length()
        starts = [0] * n_exp
        for e in range(1, n_exp):
            starts[e] = starts[e - 1] + counts[e - 1]
        levels: dict = {}
        for e, n in enumerate(counts):
            if n:
                levels.setdefault(_bucket(min(n, _MAX_ROWS)), []).append(e)
        groups = []                               # (rows per slot p, experts of the slots (-1: padding))
        for p, members in sorted(levels.items()):
            most = max(1, _GROUP_BYTES // (p * c * rows.element_size()))
            most = 1 << (most.bit_length() - 1)
            for i in range(0, len(members), most):
                chunk = members[i:i + most]
                g = min(most, cap) if fixed else min(most, 1 << (len(chunk) - 1).bit_length())
                groups.append((p, chunk + [-1] * (g - len(chunk))))
        if not groups:
            return
        # the layout of every group (first row, rows) in one small host-to-device copy
        layout = torch.tensor([[starts[e], counts[e]] if e >= 0 else [0, 0] for _, slots in groups for e in slots],
                              dtype=torch.long)
        layout = layout.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else layout.to(dev)
        chain = self._chain()
        states = [self.states_of[s].get(key) for s, _ in chain]
        at = 0
        for p, slots in groups:
            g = len(slots)
            first, size = layout[at:at + g, 0, None], layout[at:at + g, 1, None]
            at += g
            span = torch.arange(p, device=dev)
            index = [e if e >= 0 else slots[0] for e in slots]  # padding slots add nothing
            for offset in range(0, max(counts[e] for e in slots if e >= 0), p):
                valid = (offset + span) < size                                   # (g, p)
                idx = torch.where(valid, first + offset + span, 0)
                padded = rows[idx]
                mask = valid if keep is None else valid & keep[idx]
                xj, mj = to_jax(padded, name=name), to_jax(mask, name=name + " mask")
                for j, (_, statistic) in enumerate(chain):
                    if states[j] is None:
                        states[j] = statistic.init(c, n_exp, next(iter(xj.devices())))
                    states[j] = statistic.update(states[j], xj, mj, index, name=name)
        for (s, _), state in zip(chain, states):
            self.states_of[s][key] = state

    # -- results ---------------------------------------------------------------------------------------------
    def result(self, statistic: str, key):
        """The finalized state ``key`` of the statistic named ``statistic``; None if never fed."""
        state = self.states_of[statistic].get(key)
        return None if state is None else self.statistics[statistic].finalize(state)

    def hessian(self, key):
        """(finalized Hessian (C, C) or (E, C, C), token counts as a Python int or list) of the ``"hessian"``
        statistic; None if never fed."""
        return self.result(stats.HESSIAN, key)

    def importance_statistic(self, key):
        """The :class:`jgptq.imatrix.ImatrixEntry` (float32 (E, C) sums of squared inputs, float32 (E,) token
        counts) of the ``"imatrix"`` statistic over the tokens the weight saw (routed tokens only for experts, in
        every calibration mode); None if never fed."""
        return self.result(stats.IMATRIX, key)

    def release(self):
        """Drops every state (frees device memory)."""
        for states in self.states_of.values():
            states.clear()
