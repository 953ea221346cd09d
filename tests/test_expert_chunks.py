"""Routed experts a chunk at a time (jgptq_torch.pipeline.expert_chunks).

- A collector of a span of experts holds, for each of them, the very bytes of a collector of every expert (Hessian,
  token count, importance statistic), in the routed (unweighted and router-weighted) and the all-experts
  calibration. At the width 1024 a plain reduction of a group's squares (``jnp.sum`` over its rows) gives other
  bytes for a smaller group on XLA:CPU.
- A run under a device budget that fits 3 of a MoE layer's 8 experts at a time goes in 3 chunks of 3, 3 and 2 and
  writes the bytes of the run of whole layers (compressed-tensors and GGUF files, records, importance statistic,
  report), stopped after a layer and resumed too; the plan is recorded and said once; a budget below one expert
  at a time is refused before any work.
- ``keep_hessians`` in chunks of 3, 3 and 2 experts keeps the Hessians of the run of whole layers: per-expert ones
  joined over the chunks, the all-experts gate/up one and the linear modules' once.
"""

import copy
import dataclasses
import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import jgptq
from jgptq import statistics
from jgptq_torch import models
from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline.offload import DeviceBudgetError
from tests import test_ggml_pipeline as ggml_tests
from tests.cli import test_resume as resume_tests
from tests.tiny_models import build, chunk_budget, token_ids

SPANS = ((0, 3), (3, 6), (6, 8))


def files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_statistics(a, b, ordered=True):
    assert (list if ordered else sorted)(a.imatrix) == (list if ordered else sorted)(b.imatrix)
    for name, entry in a.imatrix.items():
        assert np.array_equal(entry.sums, b.imatrix[name].sums), name
        assert np.array_equal(entry.counts, b.imatrix[name].counts), name
    as_text = [json.dumps([dataclasses.asdict(r) for r in x.report.records]) for x in (a, b)]  # NaN == NaN
    assert as_text[0] == as_text[1]
    assert a.report.coverage == b.report.coverage and a.report.warnings == b.report.warnings


@pytest.mark.parametrize("every, power", [(False, 0.0), (True, 0.0), (False, 2.0)],
                         ids=["routed", "all_experts", "router_squared"])
def test_a_span_collects_the_bytes_of_a_collector_of_every_expert(every, power):
    model = build("qwen3_moe", num_hidden_layers=1, hidden_size=1024)
    ids = token_ids(4, 64, seed=3)
    experts = {n: (m, models.ExpertsLayout.of(m)) for n, m in model.named_modules() if models.is_experts_module(m)}
    capture._register()
    model.set_experts_implementation(capture.IMPLEMENTATION)

    def collect(span):
        col = capture.Collector({}, experts, statistics.calibration(all_experts=every, router_power=power), span=span)
        with torch.no_grad(), col.attach(), col.batch(torch.ones_like(ids)):
            model(ids)
        return col

    whole = collect(None)
    (name, (module, _)), = experts.items()
    assert len(set(whole.routed[name])) > 1 and all(whole.routed[name])
    for lo, hi in SPANS[:2] if every else SPANS:
        part = collect((lo, hi))
        assert part.routed == whole.routed                   # routed tokens are counted for every expert
        assert [part.sees(module, e) for e in range(8)] == [lo <= e < hi for e in range(8)]
        assert set(part.states) == set(whole.states)
        for key in whole.states:
            h, tokens = whole.hessian(key)
            got, got_tokens = part.hessian(key)
            if np.ndim(h) == 3:                              # per expert: the span's entries
                h, tokens = np.asarray(h)[lo:hi], tokens[lo:hi]
            else:                                            # gate/up of every token, shared by all experts
                assert every and key == (name, "gate_up")
            assert got_tokens == tokens and np.array_equal(np.asarray(got), np.asarray(h)), key
            entry, got_entry = whole.importance_statistic(key), part.importance_statistic(key)
            assert np.array_equal(got_entry.sums, entry.sums[lo:hi]), key
            assert np.array_equal(got_entry.counts, entry.counts[lo:hi]), key


def test_three_uneven_chunks_stopped_and_resumed_write_the_bytes_of_the_whole_layers(tmp_path, monkeypatch, caplog):
    float_model, ref, full = resume_tests.reference()            # qwen3_moe, 3 layers of 8 experts
    assert full.report.memory["expert_chunks"] == []             # no budget on the CPU: no chunks
    opts = dict(resume_tests.OPTS, offload="cpu", device_budget=chunk_budget(float_model, full, 3),
                checkpoint_dir=tmp_path / "work")
    original = resume_tests.stop_after(monkeypatch, 0)           # a run killed after its first layer
    with pytest.raises(resume_tests.Stop):
        jgptq.quantize_moe(copy.deepcopy(float_model), resume_tests.CALIB, **opts)
    monkeypatch.setattr(resume_tests.resume.Checkpoint, "save_layer", original)
    model = copy.deepcopy(float_model)
    with caplog.at_level(logging.INFO, logger="jgptq_torch.pipeline.expert_chunks"):
        result = jgptq.quantize_moe(model, resume_tests.CALIB, **opts)
    mem = result.report.memory
    assert mem["expert_chunks"] == [{"layers": [0, 1, 2], "experts": 8, "chunks": 3, "experts_per_chunk": [3, 3, 2]}]
    assert mem["need"]["experts_per_chunk"] == 3 and mem["need"]["total"] == opts["device_budget"]  # the most that fits
    said = [r.getMessage() for r in caplog.records if "chunk" in r.getMessage()]
    assert said == ["routed experts a chunk at a time to fit cpu: layers 0-2: 8 routed experts in 3 chunks of 3/2"]
    resume_tests.assert_same(ref, full, model, result)
    assert_same_statistics(full, result, ordered=False)     # a resumed run's entries come in the state's order
    for out, res, m in ((tmp_path / "whole", full, ref), (tmp_path / "chunked", result, model)):
        jgptq.export_model(m, res, "compressed-tensors", out)
    assert files(tmp_path / "whole") == files(tmp_path / "chunked")


@pytest.mark.parametrize("source", ["replay", "float"])
def test_ggml_chunks_write_the_gguf_bytes_of_the_whole_layers(tmp_path, source):
    # q4_0 with q8_0 rules and fallbacks; the importance from the run's own inputs or from the float model's
    opts = dict(ggml_tests.GPTQ, **({} if source == "replay" else {"imatrix_source": "float"}))
    float_model, ref, full = ggml_tests.run("qwen3_moe", **opts)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, ggml_tests.CALIB, device_budget=chunk_budget(float_model, full, 3),
                                offload="cpu", **ggml_tests.OPTS, **opts)
    assert [p["experts_per_chunk"] for p in result.report.memory["expert_chunks"]] == [[3, 3, 2]]
    assert any(r.method == "rtn" for r in full.report.records if "experts" in r.name)   # merged fallbacks too
    assert_same_statistics(full, result)
    assert set(full.weights) == set(result.weights)
    for key, rec in full.weights.items():
        assert np.array_equal(rec.payload, result.weights[key].payload), key
    a = jgptq.export_gguf(ref, copy.deepcopy(full), tmp_path / "whole.gguf")   # the shared run stays as it was
    b = jgptq.export_gguf(model, result, tmp_path / "chunked.gguf")
    assert Path(a).read_bytes() == Path(b).read_bytes()


def test_kept_hessians_in_chunks_are_those_of_the_whole_layer():
    float_model = build("qwen3_moe", num_hidden_layers=1)
    opts = dict(resume_tests.OPTS, calibration="all_experts", keep_hessians=True, offload="cpu")
    full = jgptq.quantize_moe(copy.deepcopy(float_model), resume_tests.CALIB, **opts)
    result = jgptq.quantize_moe(copy.deepcopy(float_model), resume_tests.CALIB, **opts,
                                device_budget=chunk_budget(float_model, full, 3))
    assert [p["experts_per_chunk"] for p in result.report.memory["expert_chunks"]] == [[3, 3, 2]]
    assert set(result.hessians) == set(full.hessians)
    ndim = {key[1] if isinstance(key[1], str) else key[1][1]: np.ndim(h) for key, (h, _) in full.hessians.items()}
    assert ndim.pop("down") == 3 and ndim.pop("gate_up") == 2       # down per expert; gate/up of every token
    assert ndim and set(ndim.values()) == {2}                        # the linear modules'
    for key, (h, tokens) in full.hessians.items():
        got, got_tokens = result.hessians[key]
        assert got_tokens == tokens and np.array_equal(np.asarray(got), np.asarray(h)), key


def test_a_finished_chunk_leaves_none_of_its_arrays_held_until_the_layer_ends(monkeypatch):
    # each chunk's stacks are kept for the layer's join: only their names and token counts, never the weight view,
    # Hessian or statistics (on a GPU, every earlier chunk's Hessians would stay on the device until the layer ends)
    from jgptq_torch.pipeline import expert_chunks

    float_model, ref, full = resume_tests.reference()
    held, real = [], expert_chunks.Passes.joined

    def joined(self, run, imatrix=None):
        held.extend(stack for parts in self.parts.values() for _, stack, _, _ in parts)
        return real(self, run, imatrix)

    monkeypatch.setattr(expert_chunks.Passes, "joined", joined)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, resume_tests.CALIB, offload="cpu", **resume_tests.OPTS,
                                device_budget=chunk_budget(float_model, full, 3))
    assert len(held) == 2 * 3 * 3          # gate/up and down stacks of 3 chunks in each of 3 layers
    assert all(s.weight is None and s.hessian is None and s.importance is None and s.statistics is None
               and s.input_scale is None and len(s.tokens) in (2, 3) for s in held)
    resume_tests.assert_same(ref, full, model, result)


def test_a_budget_below_one_expert_at_a_time_is_refused_before_any_work():
    float_model, _, full = resume_tests.reference()
    model = copy.deepcopy(float_model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DeviceBudgetError, match=r"decoder layer 0 alone needs about .* on cpu with one of its 8 "
                                                r"routed experts at a time \(parameters .*over device_budget"):
        jgptq.quantize_moe(model, resume_tests.CALIB, offload="cpu",
                           device_budget=chunk_budget(float_model, full, 1) - 1, **resume_tests.OPTS)
    assert all(v.equal(state[k]) for k, v in model.state_dict().items())


def test_each_layer_s_solves_plan_against_the_room_its_budget_leaves_them(monkeypatch):
    # On an accelerator the solves get the bytes of the layer's plan that torch does not hold (JAX's statistics do
    # not see torch's tensors); the CPU has no grant (host memory is one pool), so here the grant is made as an
    # accelerator's would be: the room, over the JAX arrays already live and the layer's parameters (torch's
    # tensors, which JAX reads without a copy and, on the CPU alone, counts as its own).
    from jgptq.parallel import memory
    from jgptq_torch.pipeline import solve

    float_model, ref, full = resume_tests.reference()
    opts = dict(resume_tests.OPTS, offload="cpu", device_budget=chunk_budget(float_model, full, 3))
    cpu = jax.devices("cpu")[0]
    granted, given, seen, own_rule = [], [], [], solve.solve_limit

    def solve_limit(placement, i):
        assert own_rule(placement, i) is None                          # the CPU's own rule
        room = placement.solve_room[i]
        granted.append(room)
        given.append(room + memory.live_bytes([cpu])[cpu] + placement.budget.layer_bytes[i])
        return {cpu: given[-1]}

    real_free = memory.free_bytes

    def free_bytes(devices, memory_limit=None, reserve=0):
        out = real_free(devices, memory_limit, reserve)
        seen.append(out[cpu])
        return out

    monkeypatch.setattr(solve, "solve_limit", solve_limit)
    monkeypatch.setattr(memory, "free_bytes", free_bytes)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, resume_tests.CALIB, **opts)
    assert len(granted) == 3 * 3                                        # every pass of every layer
    assert granted[0] == result.report.memory["need"]["solve_room"] > 0
    assert seen and all(0 <= s <= max(given) for s in seen)            # every room check saw the grant
    resume_tests.assert_same(ref, full, model, result)
    with memory.granted(None):                                          # outside a grant: unlimited on the CPU
        assert real_free([cpu])[cpu] == memory.UNLIMITED


def test_on_cuda_the_grant_leaves_torch_what_it_holds(monkeypatch):
    # the plan's room, but never more than the budget less torch's reserved bytes, once its cache has given its
    # free blocks back (the calibration forwards' intermediates would otherwise count against the solves)
    import types

    from jgptq_torch.pipeline import solve
    from jgptq_torch.pipeline.budget import Budget

    gpu = object()
    torch_side = {"tensors": 0, "cached": 0}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: sum(torch_side.values()))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: torch_side.update(cached=0))

    def placement(device, limit=None, room=None):
        return types.SimpleNamespace(device=torch.device(device), jax_device=gpu, solve_room={0: 600}, memory={},
                                     budget=Budget("cpu", limit, (100,), room=room))

    assert solve.solve_limit(placement("cuda:0", limit=1000), 0) == {gpu: 600}
    torch_side.update(tensors=100, cached=200)                            # room enough: the cache stays
    assert solve.solve_limit(placement("cuda:0", limit=1000), 0) == {gpu: 600} and torch_side["cached"] == 200
    torch_side.update(tensors=700, cached=200)
    tight = placement("cuda:0", limit=1000)
    assert solve.solve_limit(tight, 0) == {gpu: 300} and tight.memory == {"solve_granted_least": 300}
    assert torch_side["cached"] == 0
    assert solve.solve_limit(placement("cuda:0", room=800), 0) == {gpu: 100}
    torch_side.update(tensors=5000)
    assert solve.solve_limit(placement("cuda:0", limit=1000), 0) == {gpu: 0}
    assert solve.solve_limit(placement("cuda:0", limit=1000), 1) is None   # no plan for the layer
    assert solve.solve_limit(placement("cpu", limit=1000), 0) is None      # host memory: one pool
