"""Layer moves that run beside the work (jgptq_torch.pipeline.moves), turned on for the CPU here (on by default on CUDA): the
bytes are those of an un-offloaded run, at most the layers before and after the current one are on the device
with it, the booking counts them, a budget without room for them turns the moves in line again, and a move's
error stops the run with the model whole again."""

import copy
import threading
import time

import pytest
import torch

import jgptq
from jgptq_torch.pipeline import layerwise
from jgptq_torch.pipeline import offload
from jgptq_torch.pipeline.moves import Evacuation, Moves
from tests.cli import test_resume as resume_tests
from tests.test_offload import CALIB, LAYERS, OPTS, own_bytes, six_layers


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setattr(offload, "moves_ahead_on", lambda device: True)


def watch_layers(monkeypatch, model, seen):
    process = layerwise._layer_step

    def watch(run, i, layer, *args, **kwargs):
        seen.append((i, [not offload.is_released(x) for x in model.model.layers]))
        return process(run, i, layer, *args, **kwargs)

    monkeypatch.setattr(layerwise, "_layer_step", watch)


@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_moves_ahead_give_the_same_bytes_and_book_three_layers_at_most(ahead, monkeypatch, mode):
    float_model, done, full = six_layers()
    model = copy.deepcopy(float_model)
    seen = []
    watch_layers(monkeypatch, model, seen)
    result = jgptq.quantize_moe(model, CALIB, offload=mode, **OPTS)
    resume_tests.assert_same(done, full, model, result)
    mem = result.report.memory
    assert mem["moves_ahead"] is True
    layer_bytes = own_bytes(float_model.model.layers[0])
    other = own_bytes(float_model) - LAYERS * layer_bytes
    # the next layer is booked from the start of its move: two layers at least, three at most
    assert other + 2 * layer_bytes <= mem["peak_parameters_on_device"] <= other + 3 * layer_bytes
    assert mem["need"]["other_on_device"] == other + 2 * layer_bytes
    assert [i for i, _ in seen] == list(range(LAYERS))
    for i, loaded in seen:
        assert loaded[i]
        if mode == "disk":  # only the neighbours may be loaded besides the current layer
            assert not any(loaded[j] for j in range(LAYERS) if abs(j - i) > 1)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not any(offload.is_released(x) for x in model.model.layers)


def test_a_budget_without_room_for_the_neighbours_moves_in_line(ahead):
    float_model, done, full = six_layers()
    layer_bytes = own_bytes(float_model.model.layers[0])
    model = copy.deepcopy(float_model)
    probe = jgptq.quantize_moe(copy.deepcopy(float_model), CALIB, offload="cpu", **OPTS).report.memory
    alone = probe["need"]["total"] - 2 * layer_bytes                     # the need with one layer on the device
    result = jgptq.quantize_moe(model, CALIB, offload="cpu", device_budget=alone + layer_bytes, **OPTS)
    resume_tests.assert_same(done, full, model, result)
    assert result.report.memory["moves_ahead"] is False
    assert result.report.memory["need"]["total"] == alone
    assert result.report.memory["peak_parameters_on_device"] == own_bytes(float_model) - (LAYERS - 1) * layer_bytes


def test_a_failed_move_stops_the_run_and_the_model_is_whole_again(ahead, monkeypatch, tmp_path):
    float_model, done, _ = six_layers()
    model = copy.deepcopy(float_model)
    read = offload.read_layer

    def fail_on_third(layer, path, device="cpu"):
        if path.name.endswith("00003.safetensors") and threading.current_thread() is not threading.main_thread():
            raise OSError("read error")
        read(layer, path, device)

    monkeypatch.setattr(offload, "read_layer", fail_on_third)
    with pytest.raises(OSError, match="read error"):
        jgptq.quantize_moe(model, CALIB, offload="disk", offload_dir=tmp_path / "layers", **OPTS)
    assert not any(offload.is_released(x) for x in model.model.layers) and not (tmp_path / "layers").exists()
    for i, layer in enumerate(model.model.layers):  # layers 0-2 quantized, the rest as they were
        ref = (done if i <= 2 else float_model).model.layers[i].state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in layer.state_dict().items())


def test_moves_run_in_order_on_one_worker_and_raise_on_wait():
    moves = Moves(torch.device("cpu"), 1)
    order = []
    moves.submit("a", lambda: (time.sleep(0.05), order.append("a"))[1])
    moves.submit("b", lambda: order.append("b") or 7)
    with pytest.raises(RuntimeError, match="already pending"):
        moves.submit("b", lambda: None)
    assert moves.keys() == ["a", "b"] and moves.pending("a")
    assert moves.wait("b") == 7 and order == ["a", "b"] and not moves.pending("b")
    assert moves.wait("missing") is None and moves.done("missing")
    moves.submit("c", lambda: 1 / 0)
    moves.submit("d", lambda: order.append("d"))
    with pytest.raises(ZeroDivisionError):
        moves.wait_all()
    assert order == ["a", "b", "d"] and moves.keys() == []
    # a move not yet started can be dropped; one under way cannot
    started, release = threading.Event(), threading.Event()
    moves.submit("slow", lambda: (started.set(), release.wait(5)))
    moves.submit("queued", lambda: order.append("queued"))
    started.wait(5)
    assert not moves.cancel("slow") and moves.cancel("queued") and not moves.cancel("missing")
    release.set()
    moves.wait_all()
    assert "queued" not in order and moves.keys() == []
    moves.close()


def test_measured_activations_without_room_for_the_neighbours_turn_prepared_moves_in_line():
    from jgptq.config import PipelineConfig
    from tests.test_offload import Block

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 8)
            self.layers = torch.nn.ModuleList([Block() for _ in range(3)])

    model = Toy()
    layer, other = own_bytes(model.layers[0]), own_bytes(model.embed)
    cfg = PipelineConfig(offload="cpu", device_budget=other + 3 * layer + 100)
    place = offload.Placement(model, model.layers, cfg, torch.device("cpu"), ahead=True)
    place.check([offload.LayerNeed(layer, 100, 0, 0)] * 3)         # the estimate leaves room for the neighbours
    assert place.memory["moves_ahead"] is True
    place.prepare()
    place.check_activations(100 + layer)                             # the measured ones do not
    assert place.memory["moves_ahead"] is False and place.memory["need"]["total"] == other + 2 * layer + 100
    for i in range(3):                                               # one layer on the device at a time
        place.fetch(i)
        place.put_back(i)
    place.finish(failed=False)
    assert place.memory["peak_parameters_on_device"] == other + layer


def test_layers_on_the_device_leave_it_beside_the_work_from_the_last_one_back(ahead, monkeypatch):
    # on CUDA only by default (the CPU is host memory itself): here the CPU plays a device the layers start on
    monkeypatch.setattr(offload.Budget, "evacuates_beside", lambda self, ahead, device_is_host: ahead)
    tried = []
    evacuate = Evacuation._evacuate
    monkeypatch.setattr(Evacuation, "_evacuate", lambda self, j: tried.append(j) or evacuate(self, j))
    float_model, done, full = six_layers()
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, CALIB, offload="cpu", **OPTS)
    resume_tests.assert_same(done, full, model, result)
    assert tried[0] == LAYERS - 1 and tried == sorted(tried, reverse=True) and set(tried) <= set(range(LAYERS))
    mem = result.report.memory
    assert mem["moves_ahead"] is True and mem["peak_parameters_on_device"] == own_bytes(float_model)


def test_evacuation_runs_from_the_last_layer_back_and_leaves_claimed_ones():
    left, started, release = [], threading.Event(), threading.Event()

    def leave(j):
        if j == 3:
            started.set()
            release.wait(5)
        left.append(j)

    evac = Evacuation(torch.device("cpu"), [0, 1, 2, 3], leave)
    started.wait(5)                              # layer 3 under way; 2, 1, 0 queued behind it
    booked = {0, 1, 2, 3}
    evac.claim(1, booked)                        # 1 and 2 not started: dropped, still on the device
    assert booked == {0, 1, 2, 3}
    release.set()
    moved, errors = evac.end()                   # 0 ran after the claim: it stays
    assert moved == [3] and errors == {} and left == [3]
    reached = threading.Event()

    def fail_on_one(j):
        if j == 1:
            raise OSError("copy failed")
        left.append(j)
        if j == 0:
            reached.set()

    evac = Evacuation(torch.device("cpu"), [0, 1, 2], fail_on_one)
    reached.wait(5)                              # one worker, from the last layer back: 2 and 1 have ended
    with pytest.raises(OSError, match="copy failed"):  # 2 left and is unbooked first; 1 failed
        evac.unbook(booked)
    assert booked == {0, 1, 3}
    assert evac.end() == ([0], {}) and left == [3, 2, 0]
