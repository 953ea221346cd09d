"""Formats chosen per tensor group under a size budget: the knapsack behind ``target_bpw`` (pure Python + numpy).

A run with ``PipelineConfig.target_bpw`` quantizes every *group* of matrices (all experts of a layer's
projection, which loaders store as one tensor of one type, or one linear module) with one of several candidate
formats. Each candidate ``f`` of group ``g`` has an exact size ``size_g(f)`` in bits (as the exporters write it)
and a measured cost ``cost_g(f)`` (the gain-weighted output error of the group's matrices under ``f``, measured by
:mod:`jgptq_torch.pipeline.sensitivity`). The allocation minimises ``sum_g cost_g(f_g)`` subject to
``sum_g size_g(f_g) <= budget``: a multiple-choice knapsack.

- :func:`allocate` is the solver the pipeline uses. Small problems (at most ``exact_choices`` combinations, the
  exact solver's Pareto front under ``exact_front`` points) are solved exactly. Larger ones by dynamic programming over a grid of the budget
  (sizes rounded up to ``budget / grid``, so the result always fits; it wastes at most one grid unit per group),
  whose result is then polished: a fill-in pass spends what is left on the single change that lowers the cost
  most, and exchanges (one group up, another down to make room) follow while one lowers the cost. The greedy
  below is run too and its result taken where it is better. O(G K grid) for G groups of K candidates.
- :func:`greedy_allocate`: greedy by marginal gain per bit along each group's lower convex hull of (size, cost)
  points (the textbook method, optimal for the linear relaxation), then the same polish. It can miss when few
  groups take big steps (a step that does not fit leaves its bits unused); the tests bound its gap to the optimum
  on random cases.
- :func:`exact_allocate` is exact: dynamic programming over the Pareto front of (size, cost) of partial
  allocations, pruned of dominated points and of sizes over the budget.

Sizes: a GGML format takes ``type_size`` bytes per block of ``block_size`` weights (:func:`ggml_bits`); an
integer grid of ``b`` bits with groups of ``G`` columns takes ``b`` bits per weight plus a float16 scale per group
and, for asymmetric grids, a ``b``-bit zero point per group (:func:`int_bits`). A matrix left in floating point
costs 16 bits per weight (the exporters' float16 default); a float matrix excluded from a run is a fixed cost.
Candidate names are GGML format names, or ``"int2"`` .. ``"int8"`` for integer grids.
"""

from __future__ import annotations

import heapq
import math
import re
from typing import NamedTuple, Sequence

import numpy as np

# The default candidates of a GGML run, cheapest first (limited per group to what jgptq encodes and what the
# rows' block size allows).
GGML_FAMILY = ("iq1_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "q2_k", "q3_k", "iq4_xs", "q4_k",
               "q5_k", "q6_k", "q8_0")
INT_FAMILY = tuple(f"int{b}" for b in range(2, 9))
FLOAT_BITS = 16      # bits per weight of a matrix left in floating point (fixed cost)
SCALE_BITS = 16      # an integer grid's float16 scale per group
GAINS = ("fisher", "one")
_INT = re.compile(r"^int([2-8])$")


class Group(NamedTuple):
    """One decision of the allocation: ``name`` (for reports), its candidate ``formats``, the exact ``sizes`` in
    bits of the group's tensors under each (ints) and the measured ``costs`` (floats >= 0), all of one length."""

    name: str
    formats: tuple
    sizes: tuple
    costs: tuple


class Allocation(NamedTuple):
    """A solution: ``choice[g]`` indexes ``groups[g].formats``; ``size`` in bits and ``cost`` are its totals."""

    choice: tuple
    size: int
    cost: float


def int_bits_of(name: str):
    """The bit width of an integer-grid candidate name (``"int4"`` -> 4), or None for a GGML format name."""
    m = _INT.match(str(name))
    return int(m.group(1)) if m else None


def ggml_bits(fmt: str, weights: int) -> int:
    """Exact size in bits of ``weights`` values (a multiple of the block size) in GGML format ``fmt``."""
    from jgptq.ggml.registry import get_format

    f = get_format(fmt)
    if weights % f.block_size:
        raise ValueError(f"{weights} weights are not a whole number of {fmt} blocks of {f.block_size}")
    return weights // f.block_size * f.type_size * 8


def int_bits(bits: int, rows: int, cols: int, count: int, group_size: int, sym: bool) -> int:
    """Size in bits of ``count`` (rows, cols) integer-grid matrices: codes, a float16 scale per group of
    ``group_size`` columns of a row (``-1``: one group per row) and a zero point per group when asymmetric."""
    groups = 1 if group_size == -1 else -(-cols // group_size)
    return count * rows * (cols * bits + groups * (SCALE_BITS + (0 if sym else bits)))


def tensor_bits(fmt: str, rows: int, cols: int, count: int, quant) -> int:
    """Exact size in bits of ``count`` (rows, cols) matrices in candidate ``fmt`` (a GGML format, ``"int<b>"``
    with the grid of ``quant``, or ``"float"``)."""
    if fmt == "float":
        return count * rows * cols * FLOAT_BITS
    b = int_bits_of(fmt)
    if b is not None:
        return int_bits(b, rows, cols, count, quant.group_size, quant.sym)
    return count * rows * ggml_bits(fmt, cols)


def candidates(config, cols: int) -> tuple:
    """The candidate formats of a matrix of ``cols`` input columns in a run under ``config``
    (:class:`jgptq.config.PipelineConfig`): ``config.target_formats`` or the default family of the run's kind,
    less the formats whose block does not divide ``cols`` (and, without importance, those llama.cpp refuses). In
    the default GGML family a format whose block does not divide ``cols`` gives way to llama.cpp's fallback type
    (``iq4_nl``, ``q4_0``, ``q5_0``, ``q5_1``, ``q8_0``: 32-wide blocks), so that widths of 32 multiples that are
    not 256 multiples still get a range of sizes."""
    from jgptq import mixes
    from jgptq.ggml.registry import get_format

    quant = config.quant
    if not quant.is_ggml:
        names = config.target_formats or INT_FAMILY
        return tuple(n for n in names if quant.group_size == -1 or cols % quant.group_size == 0)
    out = []
    for name in config.target_formats or GGML_FAMILY:
        fmt = get_format(name)
        if not config.target_formats and cols % fmt.block_size:   # the default family: llama.cpp's fallback
            name = mixes.LLAMA_FALLBACK.get(name, name)
            fmt = get_format(name)
        if fmt.encode is None or cols % fmt.block_size or name in out:
            continue
        if config.importance == "none" and (fmt.requires_importance or name in mixes.NEEDS_IMPORTANCE):
            continue
        out.append(name)
    return tuple(out)


def check_target(config) -> None:
    """Validates the ``target_*`` fields of a :class:`jgptq.config.PipelineConfig` (normalising
    ``target_formats`` to a tuple of lower-case names). Raises ValueError naming the field and the rule."""
    from jgptq.ggml.registry import get_format

    def fail(field, value, rule):
        raise ValueError(f"PipelineConfig.{field}={value!r}: {rule}")

    bpw = config.target_bpw
    if bpw is not None:
        if isinstance(bpw, bool) or not isinstance(bpw, (int, float)) or not 0 < float(bpw) <= FLOAT_BITS * 2:
            fail("target_bpw", bpw, "must be None or a number of bits per weight in (0, 32]")
        object.__setattr__(config, "target_bpw", float(bpw))
        if config.mix is not None:
            fail("target_bpw", bpw, f"cannot be combined with mix={config.mix!r}: the target chooses every "
                 "tensor's format (fix some with formats=[(regex, format)] or exclude=[...])")
    names = (config.target_formats,) if isinstance(config.target_formats, str) else config.target_formats
    names = tuple(str(n).lower() for n in names)
    object.__setattr__(config, "target_formats", names)
    if config.target_gain not in GAINS:
        fail("target_gain", config.target_gain, f"must be one of {GAINS}")
    if not names:
        return
    if bpw is None:
        fail("target_formats", names, "candidate formats need target_bpw")
    for name in names:
        if not config.quant.is_ggml:
            if int_bits_of(name) is None:
                fail("target_formats", name, "an integer-grid run's candidates are 'int2' .. 'int8'")
            continue
        try:
            fmt = get_format(name)
        except ValueError as exc:
            fail("target_formats", name, str(exc))
        if fmt.encode is None:
            fail("target_formats", name, "jgptq has no encoder for this GGML format")


def lower_hull(sizes: Sequence[int], costs: Sequence[float]) -> list:
    """Indices of the candidates on the lower convex hull of (size, cost), by increasing size and strictly
    decreasing cost: the candidates greedy steps go through. The cheapest-size candidate (lowest cost among equal
    sizes) always starts it."""
    order = sorted(range(len(sizes)), key=lambda k: (sizes[k], costs[k]))
    hull: list = []
    for k in order:
        if hull and (sizes[k] == sizes[hull[-1]] or costs[k] >= costs[hull[-1]]):
            continue   # same size and not cheaper, or larger without lowering the cost: never worth it
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a -> k: the slope a -> b is no steeper than a -> k
            if (costs[a] - costs[b]) * (sizes[k] - sizes[a]) <= (costs[a] - costs[k]) * (sizes[b] - sizes[a]):
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def _check(groups: Sequence[Group], budget: int) -> None:
    for g in groups:
        if not g.formats or not len(g.formats) == len(g.sizes) == len(g.costs):
            raise ValueError(f"group {g.name}: needs as many sizes and costs as formats, at least one")
    least = sum(min(g.sizes) for g in groups)
    if least > budget:
        raise ValueError(f"a budget of {budget} bits is below the {least} bits of every group at its smallest "
                         f"candidate")


def _total(groups, choice) -> Allocation:
    choice = tuple(int(c) for c in choice)
    return Allocation(choice, sum(g.sizes[c] for g, c in zip(groups, choice)),
                      float(sum(g.costs[c] for g, c in zip(groups, choice))))


def allocate(groups: Sequence[Group], budget: int, *, exact_front: int = 20_000, exact_choices: int = 10**6,
             grid: int = 100_000) -> Allocation:
    """The allocation of the pipeline (module docstring): never over ``budget`` bits.

    Args:
      groups: the :class:`Group` s; budget: the most bits all groups may take together (int).
      exact_front, exact_choices: the exact solver is used for problems of at most ``exact_choices`` candidate
        combinations while its Pareto front stays within ``exact_front`` points (small problems); 0: never.
      grid: points of the budget grid of the dynamic programme used beyond (sizes rounded up to a unit of
        ``budget / grid`` bits, so the result always fits); its result is then improved by fill-in and
        exchanges, and the greedy's is taken where that is better.
    Returns:
      An :class:`Allocation`; deterministic.
    Raises:
      ValueError: a budget below every group at its smallest candidate, or a malformed group.
    """
    _check(groups, budget)
    if exact_front and math.prod(len(g.formats) for g in groups) <= exact_choices:
        try:
            return exact_allocate(groups, budget, max_front=exact_front)
        except _FrontTooLarge:
            pass
    choice = _grid_choice(groups, budget, grid)
    _polish(groups, choice, budget)
    found, greedy = _total(groups, choice), greedy_allocate(groups, budget)
    return found if found.cost <= greedy.cost else greedy


def _grid_choice(groups, budget: int, grid: int) -> list:
    """The optimum with every size rounded up to ``ceil(budget / grid)`` bits (a knapsack over a grid)."""
    unit = max(1, -(-budget // grid))
    cap = budget // unit
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    back, steps = [], []
    for g in groups:
        q = [-(-s // unit) for s in g.sizes]
        new, arg = np.full(cap + 1, np.inf), np.full(cap + 1, -1, np.int16)
        for k, (qk, ck) in enumerate(zip(q, g.costs)):
            if qk > cap:
                continue
            shifted = np.full(cap + 1, np.inf)
            shifted[qk:] = best[:cap + 1 - qk] + ck
            better = shifted < new
            new[better], arg[better] = shifted[better], k
        best = new
        back.append(arg)
        steps.append(q)
    j = int(np.argmin(best))
    if not np.isfinite(best[j]):   # rounding left no room: the smallest candidates (they fit, _check says)
        return [int(np.argmin(g.sizes)) for g in groups]
    choice = [0] * len(groups)
    for g in range(len(groups) - 1, -1, -1):
        choice[g] = int(back[g][j])
        j -= steps[g][choice[g]]
    return choice


def _polish(groups, choice: list, budget: int) -> None:
    left = _fill_in(groups, choice, budget - sum(g.sizes[c] for g, c in zip(groups, choice)))
    while _exchange(groups, choice, left):
        left = _fill_in(groups, choice, budget - sum(g.sizes[c] for g, c in zip(groups, choice)))


def greedy_allocate(groups: Sequence[Group], budget: int) -> Allocation:
    """Greedy by marginal gain per bit along each group's lower convex hull, then fill-in and exchanges (module
    docstring): never over ``budget`` bits."""
    _check(groups, budget)
    hulls = [lower_hull(g.sizes, g.costs) for g in groups]
    step = [0] * len(groups)
    choice = [h[0] for h in hulls]
    left = budget - sum(g.sizes[c] for g, c in zip(groups, choice))
    heap: list = []

    def push(i):
        h = hulls[i]
        if step[i] + 1 < len(h):
            a, b = h[step[i]], h[step[i] + 1]
            g = groups[i]
            heapq.heappush(heap, (-(g.costs[a] - g.costs[b]) / (g.sizes[b] - g.sizes[a]), i))

    for i in range(len(groups)):
        push(i)
    while heap:
        _, i = heapq.heappop(heap)
        g, nxt = groups[i], hulls[i][step[i] + 1]
        extra = g.sizes[nxt] - g.sizes[choice[i]]
        if extra > left:
            continue   # this group's next step does not fit; its later steps are larger still
        left -= extra
        choice[i], step[i] = nxt, step[i] + 1
        push(i)
    _polish(groups, choice, budget)
    return _total(groups, choice)


def _fill_in(groups, choice: list, left: int) -> int:
    """Spends ``left`` bits on the single change that lowers the cost most, until none fits; returns the rest."""
    while True:
        best = None
        for i, g in enumerate(groups):
            c = choice[i]
            for k in range(len(g.formats)):
                extra, gain = g.sizes[k] - g.sizes[c], g.costs[c] - g.costs[k]
                if gain > 0 and extra <= left and (best is None or gain > best[0]):
                    best = (gain, i, k, extra)
        if best is None:
            return left
        _, i, k, extra = best
        choice[i], left = k, left - extra


def _exchange(groups, choice: list, left: int) -> bool:
    """Applies the best pair of changes (one group up, another down to make room) that lowers the total cost;
    returns whether one did."""
    owner, freed, rise = [], [], []
    for j, g in enumerate(groups):
        c = choice[j]
        for k in range(len(g.formats)):
            if g.sizes[k] < g.sizes[c]:
                owner.append(j)
                freed.append(g.sizes[c] - g.sizes[k])
                rise.append(g.costs[k] - g.costs[c])
    if not owner:
        return False
    owner, freed, rise = np.array(owner), np.array(freed), np.array(rise)
    best = None
    for i, g in enumerate(groups):
        c = choice[i]
        for k in range(len(g.formats)):
            gain, need = g.costs[c] - g.costs[k], g.sizes[k] - g.sizes[c] - left
            if gain <= 0 or need <= 0:
                continue
            ok = (freed >= need) & (owner != i)
            if not ok.any():
                continue
            m = int(np.flatnonzero(ok)[np.argmin(rise[ok])])
            net = gain - rise[m]
            if net > 1e-12 * max(g.costs[c], 1e-300) and (best is None or net > best[0]):
                best = (net, i, k, m)
    if best is None:
        return False
    _, i, k, m = best
    j = int(owner[m])
    target = groups[j].sizes[choice[j]] - int(freed[m])
    choice[j] = next(n for n in range(len(groups[j].formats)) if groups[j].sizes[n] == target and
                     groups[j].costs[n] - groups[j].costs[choice[j]] == rise[m])
    choice[i] = k
    return True


class _FrontTooLarge(Exception):
    pass


def exact_allocate(groups: Sequence[Group], budget: int, *, max_front: int = 0) -> Allocation:
    """The optimal allocation (lowest total cost within ``budget`` bits), by dynamic programming over the Pareto
    front of partial allocations. Exponential in the worst case (``max_front``: give up beyond that many points,
    0: never)."""
    _check(groups, budget)
    front = [(0, 0.0, ())]      # (size, cost, choice) of the groups so far, Pareto-optimal
    for g in groups:
        grown = sorted(((s + g.sizes[k], c + g.costs[k], ch + (k,)) for s, c, ch in front
                        for k in range(len(g.formats)) if s + g.sizes[k] <= budget), key=lambda t: (t[0], t[1]))
        front, best = [], float("inf")
        for item in grown:
            if item[1] < best:
                front.append(item)
                best = item[1]
        if max_front and len(front) > max_front:
            raise _FrontTooLarge
    size, cost, choice = min(front, key=lambda t: (t[1], t[0]))
    return _total(groups, choice)
