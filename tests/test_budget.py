"""The device budget in plain numbers (jgptq_torch.pipeline.budget): the estimated need of a layer from its shapes (closed forms
worked by hand below), whether moves run beside the work, the worst layer and its record, the exact messages of
a run over the budget, and the chunks of routed experts of a layer over it."""

import pytest

from jgptq_torch.pipeline.budget import (Budget, DeviceBudgetError, LayerNeed, LayerWork, Verdict, balanced,
                                         chunk_note, chunk_summary, estimate_need)

KB = 1000
LAYER = 1000                                  # parameter bytes of each of three layers
OTHER = 500                                   # bytes outside the layers on the device
EVEN = LayerNeed(parameters=1000, activations=200, hessians=300, solve=500)        # total 2000


def budget(mode="cpu", limit=None, resident=(), device="cuda:0"):
    return Budget(mode, limit, (LAYER,) * 3, OTHER, frozenset(resident), device)


def test_estimate_need_counts_hessians_results_and_the_largest_bucket():
    # one linear 3 x 4: Hessian 4*4 = 16, results 3*4 = 12, bucket of one: 1 * 4 * (2*4 + 3*3) = 68
    # experts: 2 experts, hidden 4, inter 2, gate/up fused (4 rows):
    #   Hessians 2 * 4*4 (gate/up, one per expert) + 2 * 2*2 (down) = 40; all_experts: 4*4 + 8 = 24
    #   results 2 * (4*4 + 4*2) = 48; buckets gate/up 2 * 4 * (2*4 + 3*4) = 160, down 2 * 2 * (2*2 + 3*4) = 64
    # float32: Hessians 4 * (16 + 40) = 224, solve 4 * (12 + 48 + 160) = 880
    need = estimate_need(100, 10, [(1, 3, 4, "linear"), (2, 4, 4, "expert_gate_up"), (2, 4, 2, "expert_down")], all_experts=False)
    assert need == LayerNeed(parameters=100, activations=10, hessians=224, solve=880)
    assert need.total == 1214
    shared = estimate_need(100, 10, [(1, 3, 4, "linear"), (2, 4, 4, "expert_gate_up"), (2, 4, 2, "expert_down")], all_experts=True)
    assert shared.hessians == 4 * (16 + 24) and shared.solve == 880
    # two linears of one shape form one bucket: 2 * 4 * (2*4 + 3*3) = 136 > the experts' 0
    assert estimate_need(0, 0, [(1, 3, 4, "linear"), (1, 3, 4, "linear")], False) == LayerNeed(0, 0, 4 * 32, 4 * (24 + 136))
    assert estimate_need(7, 0, [], False) == LayerNeed(7, 0, 0, 0)


def test_moves_beside_the_work_only_when_offloading_unshared_layers_on_request():
    assert budget("cpu").moves_ahead(shared=False, wanted=True) is True
    assert budget("disk").moves_ahead(shared=False, wanted=True) is True
    assert budget("none").moves_ahead(shared=False, wanted=True) is False
    assert budget("cpu").moves_ahead(shared=True, wanted=True) is False
    assert budget("cpu").moves_ahead(shared=False, wanted=False) is False
    # the layers on the device leave beside the work only with cpu offload, moves ahead, no limit, a real device
    assert budget("cpu").evacuates_beside(ahead=True, device_is_host=False) is True
    assert budget("cpu", limit=10 ** 9).evacuates_beside(ahead=True, device_is_host=False) is False
    assert budget("cpu").evacuates_beside(ahead=False, device_is_host=False) is False
    assert budget("cpu").evacuates_beside(ahead=True, device_is_host=True) is False
    assert budget("disk").evacuates_beside(ahead=True, device_is_host=False) is False
    with pytest.raises(ValueError, match=r"offload mode 'ram': expected one of \('none', 'cpu', 'disk'\)"):
        budget("ram")


def test_booking_counts_the_layers_on_the_device_and_what_stays_there():
    assert budget().booked(set()) == 500
    assert budget().booked({0, 2}) == 2500
    assert Budget("cpu", None, (10, 20, 30), 1).booked([1, 2]) == 51


def test_totals_add_the_neighbours_of_moves_ahead_and_resident_layers():
    needs = [EVEN] * 3
    assert [budget().total(needs, i) for i in range(3)] == [2500] * 3
    assert [budget().total(needs, i, ahead=True) for i in range(3)] == [3500, 4500, 3500]
    kept = budget("none", resident={0, 1, 2})
    assert [kept.total(needs, i) for i in range(3)] == [4500] * 3              # the two others stay there
    assert kept.total(needs, 0, offloaded=True) == 2500


def test_the_worst_layer_and_its_record_without_a_limit():
    needs = [EVEN, LayerNeed(1000, 200, 300, 900), EVEN]                        # layer 1: total 2400
    verdict = budget().assess(needs, ahead=True)
    assert verdict == Verdict(ahead=True, layer=1, need=needs[1], total=4900)  # 500 + two neighbours + 2400
    assert verdict.fits and verdict.problem == ""
    verdict.raise_if_over()
    assert verdict.record() == {"layer": 1, "parameters": 1000, "activations": 200, "hessians": 300, "solve": 900,
                                "other_on_device": 2500, "total": 4900}
    even = budget().assess([EVEN] * 3, ahead=False)                            # equals: the first one
    assert (even.layer, even.total, even.ahead) == (0, 2500, False)


def test_a_limit_without_room_for_the_neighbours_turns_the_moves_in_line():
    verdict = budget(limit=4000).assess([EVEN] * 3, ahead=True)                # ahead: 4500 at layer 1
    assert (verdict.ahead, verdict.layer, verdict.total, verdict.fits) == (False, 0, 2500, True)
    assert verdict.record()["other_on_device"] == 500
    roomy = budget(limit=4500).assess([EVEN] * 3, ahead=True)
    assert (roomy.ahead, roomy.layer, roomy.total, roomy.fits) == (True, 1, 4500, True)


def test_over_the_limit_the_message_says_by_how_much_and_what_helps():
    verdict = budget(limit=2400).assess([EVEN] * 3, ahead=True)
    assert not verdict.fits and verdict.ahead is False
    message = ("decoder layer 0 alone needs about 2.00 kB on cuda:0 (parameters 1.00 kB, activations 200 B, "
               "Hessians 300 B, solve 500 B), plus 500 B of tensors that stay there: 2.50 kB, over device_budget "
               "2.40 kB. Offloading other layers cannot lower this; fewer calibration tokens (samples x length) "
               "shrink the activations, moving the embeddings and head off the device frees theirs, or raise the "
               "budget")
    assert verdict.problem == message
    with pytest.raises(DeviceBudgetError) as err:
        verdict.raise_if_over()
    assert str(err.value) == message and isinstance(err.value, ValueError)
    assert verdict.record() == {"layer": 0, "parameters": 1000, "activations": 200, "hessians": 300, "solve": 500,
                                "other_on_device": 500, "total": 2500, "solve_room": 2400 - 500 - 1000 - 200}


def test_resident_layers_over_the_limit_point_to_offloading_when_it_would_fit():
    kept = budget("none", limit=3 * KB, resident={0, 1, 2}, device="cpu")
    verdict = kept.assess([EVEN] * 3, ahead=False)
    assert (verdict.layer, verdict.total) == (0, 4500)
    assert verdict.problem == (
        "offload='none' keeps 3 decoder layers (3.00 kB) on cpu; with 500 B of other tensors there and layer 0's "
        "work the run needs about 4.50 kB, over device_budget 3.00 kB. Use offload='cpu' (layers in host memory, "
        "one at a time on the device) or offload='disk' (layers in files, for models larger than host memory); "
        "command line: --offload cpu|disk")
    # a limit that even one layer at a time exceeds: offloading cannot help, the layer's own need is the message
    tight = budget("none", limit=2 * KB, resident={0, 1, 2}, device="cpu").assess([EVEN] * 3, ahead=False)
    assert tight.problem.startswith("decoder layer 0 alone needs about 2.00 kB on cpu (parameters 1.00 kB, "
                                    "activations 200 B, Hessians 300 B, solve 500 B), plus 2.50 kB of tensors that "
                                    "stay there: 4.50 kB, over device_budget 2.00 kB. Offloading other layers")
    # no layer resident: nothing to offload, the layer's own message
    alone = budget("none", limit=2 * KB, device="cpu").assess([EVEN] * 3, ahead=False)
    assert alone.total == 2500 and alone.problem.startswith("decoder layer 0 alone needs about 2.00 kB on cpu")


# a linear 3 x 4 and 8 experts (hidden 4, inter 2): by the closed form of the first test, with k experts per chunk
# Hessians 4 * (16 + 20k), results 4 * (12 + 24k), largest bucket 4 * max(68, 80k): total 222 + 496k (k >= 1)
EXPERTS = LayerWork(100, 10, ((1, 3, 4, "linear"), (8, 4, 4, "expert_gate_up"), (8, 4, 2, "expert_down")), False)


def test_a_layer_needs_less_with_fewer_experts_per_chunk():
    assert EXPERTS.experts == 8 and EXPERTS.need() == EXPERTS.need(8) == estimate_need(100, 10, EXPERTS.matrices, False)
    assert [EXPERTS.need(k).total for k in (1, 2, 3, 8)] == [718, 1214, 1710, 4190]
    assert EXPERTS.need(1) == LayerNeed(100, 10, 4 * 36, 4 * (36 + 80))
    assert LayerWork(1, 2, EXPERTS.matrices, False, chunkable=False).experts == 0
    assert LayerWork(1, 2, ((1, 3, 4, "linear"),), False).experts == 0
    assert balanced(8, 3) == (3, 3, 2) and balanced(8, 2) == (2, 2, 2, 2) and balanced(8, 7) == (4, 4)
    assert balanced(256, 125) == (86, 85, 85) and balanced(5, 9) == (5,)


def test_a_layer_over_the_limit_goes_in_the_fewest_chunks_that_fit():
    for limit, sizes in [(500 + 4190, None), (500 + 222 + 496 * 7, (4, 4)), (500 + 222 + 496 * 3, (3, 3, 2)),
                         (500 + 222 + 496 * 3 - 1, (2, 2, 2, 2)), (500 + 718, (1,) * 8)]:
        verdict = budget(limit=limit).assess([EXPERTS] * 3, ahead=False)
        assert verdict.fits, limit
        assert verdict.chunks == ({} if sizes is None else dict.fromkeys(range(3), sizes))
        assert verdict.need == EXPERTS.need(max(sizes or (8,))) and verdict.total <= limit
        assert ("experts_per_chunk" in verdict.record()) == (sizes is not None)
    record = budget(limit=2210).assess([EXPERTS, LayerNeed(100, 10, 100, 100), EXPERTS], ahead=False)
    assert record.chunks == {0: (3, 3, 2), 2: (3, 3, 2)}      # a fixed need is never split
    assert record.record() == {"layer": 0, "parameters": 100, "activations": 10, "hessians": 4 * 76,
                               "solve": 4 * 324, "other_on_device": 500, "total": 2210, "experts_per_chunk": 3,
                               "solve_room": 2210 - 500 - 100 - 10}
    summary = chunk_summary(record.chunks)
    assert summary == [{"layers": [0, 2], "experts": 8, "chunks": 3, "experts_per_chunk": [3, 3, 2]}]
    assert chunk_note(summary, "cuda:0") == ("routed experts a chunk at a time to fit cuda:0: layers 0,2: 8 routed "
                                             "experts in 3 chunks of 3/2")
    assert chunk_summary({3: (2, 2), 4: (2, 2), 5: (3, 3, 2)}) == [
        {"layers": [3, 4], "experts": 4, "chunks": 2, "experts_per_chunk": [2, 2]},
        {"layers": [5], "experts": 8, "chunks": 3, "experts_per_chunk": [3, 3, 2]}]
    assert chunk_note([], "cpu") == ""


def test_only_one_expert_per_chunk_over_the_limit_is_refused():
    verdict = budget(limit=500 + 717).assess([EXPERTS] * 3, ahead=False)
    assert not verdict.fits and verdict.need == EXPERTS.need(1) and verdict.chunks == dict.fromkeys(range(3), (1,) * 8)
    assert verdict.problem.startswith("decoder layer 0 alone needs about 718 B on cuda:0 with one of its 8 routed "
                                      "experts at a time (parameters 100 B, activations 10 B, Hessians 144 B, solve "
                                      "464 B), plus 500 B of tensors that stay there: 1.22 kB, over device_budget")
    whole = LayerWork(100, 10, EXPERTS.matrices, False, chunkable=False)  # several experts modules: never split
    stuck = budget(limit=2000).assess([whole] * 3, ahead=False)
    assert not stuck.fits and stuck.chunks == {} and stuck.need == EXPERTS.need()
    assert stuck.problem.startswith("decoder layer 0 alone needs about 4.19 kB on cuda:0 (parameters")


def test_without_a_limit_chunks_follow_the_room_and_never_refuse():
    roomy = Budget("cpu", None, (LAYER,) * 3, OTHER, room=500 + 1710)
    assert roomy.assess([EXPERTS] * 3, ahead=False).chunks == dict.fromkeys(range(3), (3, 3, 2))
    tight = Budget("cpu", None, (LAYER,) * 3, OTHER, room=10).assess([EXPERTS] * 3, ahead=False)
    assert tight.fits and tight.chunks == dict.fromkeys(range(3), (1,) * 8)
    assert budget().assess([EXPERTS] * 3, ahead=False).chunks == {}          # no limit, no room: whole layers


def test_moves_ahead_stay_only_when_they_cost_no_extra_chunk():
    # with both neighbours on the device (2 x 1000 B) the layers need chunks; in line they fit whole
    verdict = budget(limit=500 + 2000 + 222 + 496 * 5).assess([EXPERTS] * 3, ahead=True)
    assert (verdict.ahead, verdict.chunks, verdict.need) == (False, {}, EXPERTS.need())
    roomy = budget(limit=500 + 2000 + 4190).assess([EXPERTS] * 3, ahead=True)
    assert (roomy.ahead, roomy.chunks) == (True, {})
    # no room in line either: the same chunks both ways, so the moves stay beside the work
    room = Budget("cpu", None, (LAYER,) * 3, OTHER, room=10).assess([EXPERTS] * 3, ahead=True)
    assert room.ahead and room.chunks == dict.fromkeys(range(3), (1,) * 8)


def test_the_solves_are_granted_what_the_plan_leaves_them():
    # the limit (or the room) less what stays on the device, the layer's parameters and its activations: a chunk's
    # Hessians and solve fit in it, and so does a whole layer's where it fits whole
    for limit in (500 + 222 + 496 * 3, 500 + 718, 500 + 4190, 10 ** 6):
        verdict = budget(limit=limit).assess([EXPERTS] * 3, ahead=False)
        assert verdict.solve_room == dict.fromkeys(range(3), limit - OTHER - 100 - 10)
        assert verdict.need.hessians + verdict.need.solve <= verdict.solve_room[0]
    ahead = budget(limit=10 ** 6).assess([EVEN] * 3, ahead=True)          # the neighbours coming and going count
    assert ahead.ahead and ahead.solve_room == {0: 10 ** 6 - 500 - 1000 - 1200, 1: 10 ** 6 - 500 - 2000 - 1200,
                                                2: 10 ** 6 - 500 - 1000 - 1200}
    room = Budget("cpu", None, (LAYER,) * 3, OTHER, room=500 + 1710).assess([EXPERTS] * 3, ahead=False)
    assert room.solve_room == dict.fromkeys(range(3), 1710 - 110)
    tight = Budget("cpu", None, (LAYER,) * 3, OTHER, room=10).assess([EXPERTS] * 3, ahead=False)
    assert tight.solve_room == dict.fromkeys(range(3), 0)                   # never negative
    assert budget().assess([EXPERTS] * 3, ahead=False).solve_room == {}    # no limit, no room: no grant
