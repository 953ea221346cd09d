"""jgptq.allocate: the knapsack of target_bpw against brute force, its guarantees, and the sizes it counts."""

import itertools

import numpy as np
import pytest

from jgptq import allocate as alloc
from jgptq.config import PipelineConfig, QuantConfig


def random_groups(rng, n_groups, n_formats):
    """Groups whose costs fall with size, roughly exponentially (as quantization errors do), with noise."""
    groups = []
    for g in range(n_groups):
        weights = int(rng.integers(1, 9)) * 256
        bpw = np.sort(rng.choice(np.arange(2, 17), n_formats, replace=False))
        sizes = tuple(int(b * weights) for b in bpw)
        scale = rng.uniform(0.1, 10.0)
        costs = tuple(float(scale * 2.0 ** -b * rng.uniform(0.5, 1.5)) for b in bpw)
        groups.append(alloc.Group(f"g{g}", tuple(f"f{b}" for b in bpw), sizes, costs))
    return groups


def brute_force(groups, budget):
    best = None
    for choice in itertools.product(*(range(len(g.formats)) for g in groups)):
        size = sum(g.sizes[c] for g, c in zip(groups, choice))
        cost = sum(g.costs[c] for g, c in zip(groups, choice))
        if size <= budget and (best is None or cost < best[1]):
            best = (size, cost)
    return best


def test_the_greedy_is_within_a_small_margin_of_exact_and_never_over_budget():
    rng = np.random.default_rng(0)
    gaps = []
    for case in range(200):
        small = case < 60
        groups = random_groups(rng, int(rng.integers(2, 6) if small else rng.integers(6, 10)),
                               int(rng.integers(2, 5)))
        low, high = sum(min(g.sizes) for g in groups), sum(max(g.sizes) for g in groups)
        budget = int(rng.integers(low, high + 1))
        greedy, grid = alloc.greedy_allocate(groups, budget), alloc.allocate(groups, budget, exact_front=0)
        exact, default = alloc.exact_allocate(groups, budget), alloc.allocate(groups, budget)
        if small:
            size, cost = brute_force(groups, budget)
            assert exact.cost == pytest.approx(cost, rel=1e-12)          # the DP is exact
        assert default == exact                                           # small problems are solved exactly
        for found in (greedy, grid, exact):
            assert found.size <= budget
            assert found.size == sum(g.sizes[c] for g, c in zip(groups, found.choice))
            assert found.cost == pytest.approx(sum(g.costs[c] for g, c in zip(groups, found.choice)), rel=1e-12)
            assert found.cost >= exact.cost * (1 - 1e-12)
        gaps.append((greedy.cost / exact.cost - 1, grid.cost / exact.cost - 1))
    greedy_gap, grid_gap = np.array(gaps).T
    assert np.mean(grid_gap) < 0.002 and grid_gap.max() < 0.02, (grid_gap.mean(), grid_gap.max())
    assert np.mean(greedy_gap) < 0.05 and np.quantile(greedy_gap, 0.9) < 0.05, (greedy_gap.mean(), greedy_gap.max())


def test_with_many_groups_greedy_is_nearly_exact():
    rng = np.random.default_rng(1)
    for _ in range(10):
        groups = random_groups(rng, 24, 4)
        low, high = sum(min(g.sizes) for g in groups), sum(max(g.sizes) for g in groups)
        budget = (low + high) // 2
        greedy, grid = alloc.greedy_allocate(groups, budget), alloc.allocate(groups, budget, exact_front=0)
        exact = alloc.exact_allocate(groups, budget)
        assert greedy.size <= budget and greedy.cost <= exact.cost * 1.05
        assert grid.size <= budget and grid.cost <= exact.cost * 1.001


def test_enough_budget_gives_every_group_its_best_format_and_too_little_is_refused():
    rng = np.random.default_rng(2)
    groups = random_groups(rng, 6, 4)
    best = tuple(int(np.argmin(g.costs)) for g in groups)
    for front in (0, 20_000):
        assert alloc.allocate(groups, sum(max(g.sizes) for g in groups), exact_front=front).choice == best
        assert alloc.allocate(groups, 10**12, exact_front=front).choice == best
    least = sum(min(g.sizes) for g in groups)
    assert alloc.allocate(groups, least).choice == tuple(int(np.argmin(g.sizes)) for g in groups)
    with pytest.raises(ValueError, match=rf"^a budget of {least - 1} bits is below the {least} bits of every group "
                                         r"at its smallest candidate$"):
        alloc.allocate(groups, least - 1)


def test_cost_never_rises_with_the_budget():
    rng = np.random.default_rng(3)
    groups = random_groups(rng, 8, 4)
    low, high = sum(min(g.sizes) for g in groups), sum(max(g.sizes) for g in groups)
    for front in (0, 20_000):
        costs = [alloc.allocate(groups, b, exact_front=front).cost for b in np.linspace(low, high, 40).astype(int)]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(costs, costs[1:])), front


def test_lower_hull_drops_dominated_and_non_convex_points():
    # sizes 1..5; (3, 4.0) lies above the segment (2, 5) -> (4, 1); (5, 1.0) costs as much as (4, 1.0)
    assert alloc.lower_hull([1, 2, 3, 4, 5], [10.0, 5.0, 4.0, 1.0, 1.0]) == [0, 1, 3]
    assert alloc.lower_hull([4, 1, 4], [1.0, 3.0, 0.5]) == [1, 2]


def test_sizes_are_the_bytes_the_formats_write():
    assert alloc.ggml_bits("q4_k", 512) == 2 * 144 * 8
    assert alloc.ggml_bits("q8_0", 64) == 2 * 34 * 8
    assert alloc.ggml_bits("iq2_xxs", 256) == 66 * 8
    with pytest.raises(ValueError, match="^100 weights are not a whole number of q4_0 blocks of 32$"):
        alloc.ggml_bits("q4_0", 100)
    q = QuantConfig(group_size=128, sym=True)
    assert alloc.tensor_bits("int4", 8, 256, 2, q) == 2 * 8 * (256 * 4 + 2 * 16)
    assert alloc.tensor_bits("int3", 8, 256, 1, q.replace(sym=False)) == 8 * (256 * 3 + 2 * (16 + 3))
    assert alloc.tensor_bits("int4", 8, 256, 1, q.replace(group_size=-1)) == 8 * (256 * 4 + 16)
    assert alloc.tensor_bits("float", 8, 256, 3, q) == 3 * 8 * 256 * 16


def test_candidates_follow_the_run_kind_and_the_row_width():
    ggml = PipelineConfig.build(None, format="q4_k", target_bpw=3.0)
    assert alloc.candidates(ggml, 512) == alloc.GGML_FAMILY
    # only 32-blocks fit 96 columns: the default candidates take llama.cpp's 32-wide fallback types there
    assert alloc.candidates(ggml, 96) == ("iq4_nl", "q4_0", "q5_0", "q5_1", "q8_0")
    plain = PipelineConfig.build(None, format="q4_k", target_bpw=3.0, importance="none")
    assert "iq2_xxs" not in alloc.candidates(plain, 512) and "q2_k" in alloc.candidates(plain, 512)
    grid = PipelineConfig.build(None, group_size=64, target_bpw=3.0)
    assert alloc.candidates(grid, 128) == alloc.INT_FAMILY and alloc.candidates(grid, 96) == ()
    own = PipelineConfig.build(None, target_bpw=3.0, target_formats=("INT3", "int5"))
    assert own.target_formats == ("int3", "int5") and alloc.candidates(own, 128) == ("int3", "int5")


@pytest.mark.parametrize("kwargs, message", [
    (dict(format="q4_k", target_bpw=2.5, mix="q4_k_m"),
     "PipelineConfig.target_bpw=2.5: cannot be combined with mix='q4_k_m': the target chooses every tensor's "
     "format (fix some with formats=[(regex, format)] or exclude=[...])"),
    (dict(target_bpw=0), "PipelineConfig.target_bpw=0: must be None or a number of bits per weight in (0, 32]"),
    (dict(target_bpw="2.5"), "PipelineConfig.target_bpw='2.5': must be None or a number of bits per weight in "
                             "(0, 32]"),
    (dict(target_formats=("int4",)), "PipelineConfig.target_formats=('int4',): candidate formats need target_bpw"),
    (dict(target_bpw=3, target_formats=("q4_k",)),
     "PipelineConfig.target_formats='q4_k': an integer-grid run's candidates are 'int2' .. 'int8'"),
    (dict(format="q4_k", target_bpw=3, target_formats=("q9_k",)), "PipelineConfig.target_formats='q9_k': unknown "
                                                                   "GGML format 'q9_k'; known formats: "),
    (dict(target_bpw=3, target_gain="kl"), "PipelineConfig.target_gain='kl': must be one of ('fisher', 'one')"),
])
def test_bad_targets_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        PipelineConfig.build(None, **kwargs)
    assert str(err.value).startswith(message), str(err.value)


def relaxation_bound(groups, budget):
    """The optimum of the linear relaxation (a lower bound of any allocation's cost): hull steps of every group
    taken by falling slope, the last one in part. Written out here with numpy, from the points themselves."""
    cost, left, steps = 0.0, budget, []
    for g in groups:
        pts = sorted(zip(g.sizes, g.costs))
        hull = []
        for p in pts:   # monotone chain: the lower-left convex hull, non-increasing cost
            if hull and p[1] >= hull[-1][1]:
                continue
            while len(hull) >= 2:
                (ax, ay), (bx, by) = hull[-2], hull[-1]
                if (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax) > 0:   # a left turn: b stays
                    break
                hull.pop()
            hull.append(p)
        cost += hull[0][1]
        left -= hull[0][0]
        steps += [((a[1] - b[1]) / (b[0] - a[0]), b[0] - a[0], a[1] - b[1]) for a, b in zip(hull, hull[1:])]
    for slope, size, drop in sorted(steps, reverse=True):
        take = min(1.0, left / size)
        cost -= take * drop
        left -= take * size
        if take < 1:
            break
    return cost


def test_large_problems_come_within_a_percent_of_the_relaxation_bound():
    rng = np.random.default_rng(4)
    bpw = np.array([1.5625, 2.0625, 2.3125, 2.5625, 2.625, 3.0625, 3.4375, 4.25, 4.5, 5.5, 6.5625, 8.5])
    groups = []
    for layer in range(24):
        for n in (4096 * 2048, 512 * 2048, 512 * 2048, 2048 * 4096, 64 * 1536 * 2048, 64 * 2048 * 768):
            costs = tuple(float(rng.uniform(0.5, 2) * 2.0 ** (-1.6 * b) * n * 1e-9) for b in bpw)
            groups.append(alloc.Group(str(layer), tuple(map(str, bpw)), tuple(int(b * n) for b in bpw), costs))
    weights = sum(g.sizes[0] / 1.5625 for g in groups)
    for target in (2.0, 2.5, 3.5, 5.0):
        budget = int(target * weights)
        found = alloc.allocate(groups, budget)
        assert found.size <= budget
        assert relaxation_bound(groups, budget) <= found.cost <= relaxation_bound(groups, budget) * 1.01
        assert found.cost <= alloc.greedy_allocate(groups, budget).cost
