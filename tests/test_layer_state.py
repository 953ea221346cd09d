"""State the forward hands from one decoder layer to the next is carried by the run of one layer at a time: a
layer's further outputs (GLM-5's and Hunyuan V4's indexer top-k, Kolibri 1.1's candidate pool) and a container
several layers share (Kolibri 1.1's keys and values, read by a later layer). The inputs the run gives each layer
are those of the model's own forward, bit for bit; quantize_moe runs end to end (also resumed from a checkpoint);
forwards that hand on state jgptq cannot carry are refused with the reason."""

import pytest
import torch
from torch import nn

import jgptq
from jgptq_torch.models import UnsupportedModelError
from jgptq_torch.pipeline import resume
from jgptq_torch.pipeline.calib import batches
from jgptq_torch.pipeline.inputs import capture_inputs
from jgptq_torch.pipeline.layer_state import Carried, Shared, output_arity, run_layer
from tests.tiny_models import build, next_token_kl, token_ids

transformers = pytest.importorskip("transformers")
CALIB = token_ids(4, 16, seed=1)
FSF = {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"], "index_topk_pattern": "FSF"}
FOUR = {"num_hidden_layers": 4, "kv_source_layers": [0, 1, 1, 3],     # Kolibri 1.1 with a layer after the reader
        "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention"]}


def _hooked_inputs(model, ids):
    """Each decoder layer's (hidden states, prev_topk_indices) in the model's own forward, and its logits."""
    seen, handles = [], []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kw: seen.append((args[0].clone(), kw.get("prev_topk_indices"))), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_layer_by_layer_inputs_are_the_forward_inputs():
    model = build("glm_moe_dsa", **FSF)
    assert model.config.indexer_types == ["full", "shared", "full"]
    assert output_arity(model.model.layers[0]) == 2                    # read from transformers' annotation
    ids = CALIB[:2]
    want, logits = _hooked_inputs(model, ids)
    batch_list = batches(ids, batch_size=2)
    with torch.no_grad():
        hidden, layer_inputs = capture_inputs(model, model.model.layers, batch_list, torch.device("cpu"))
        assert layer_inputs[0][1][1]["prev_topk_indices"].__class__ is Carried   # a link, not a captured value
        hs = hidden[0]
        for i, layer in enumerate(model.model.layers):
            assert torch.equal(hs, want[i][0]), i
            rest, kw = layer_inputs[0][i]
            if i:
                assert torch.equal(hs.carried[1], want[i][1]), i        # the indices the forward handed on
            hs = run_layer(layer, hs, rest, kw)
        got = model.lm_head(model.model.norm(hs))
        assert torch.equal(got, logits)
        # the carried indices matter: layer 1 given other indices computes something else
        rest, kw = layer_inputs[0][1]
        other = torch.flip(want[1][1], dims=[-1]).roll(3, dims=1)
        out = model.model.layers[1](want[1][0], *rest, **{**kw, "prev_topk_indices": other})
        assert not torch.equal(out[0], want[2][0])


def _layer_by_layer(model, ids):
    """(each layer's hidden states in the model's own forward and its last layer's output; the same from the
    captured inputs run one layer at a time, and those inputs)."""
    layers = model.model.layers
    seen, handles = [], []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone())))
    handles.append(layers[-1].register_forward_hook(lambda m, args, out: seen.append(
        (out[0] if isinstance(out, tuple) else out).clone())))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        hidden, layer_inputs = capture_inputs(model, layers, batches(ids, batch_size=len(ids)), torch.device("cpu"))
        got = [hidden[0]]
        for i, layer in enumerate(layers):
            got.append(run_layer(layer, got[-1], *layer_inputs[0][i]))
    return seen, got, layer_inputs[0]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["hy_v4", "kolibri1_1"])
def test_layer_by_layer_hidden_states_are_the_forwards(family):
    model = build(family)
    want, got, inputs = _layer_by_layer(model, CALIB[:2])
    assert len(want) == len(got) == len(model.model.layers) + 1
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), i
    links = [type(v) for _, kw in inputs for v in kw.values() if isinstance(v, (Carried, Shared))]
    if family == "kolibri1_1":
        assert model.config.kv_source_layers == [0, 1, 1]             # layer 2 reads layer 1's keys and values
        assert links.count(Shared) == 3 and links.count(Carried) == 1   # the container; layer 1's pool to layer 2
        assert set(got[2].shared[0]) >= {"1"}                             # what layer 1 wrote, carried to layer 2
    else:
        assert model.config.indexer_types == ["full", "shared"] and links == [Carried]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.slow     # about 40 s on 2 cores
def test_quantize_moe_glm_moe_dsa(tmp_path):
    """Round-to-nearest and GPTQ end to end: next-token KL to the float model small, GPTQ's under RTN's; the GPTQ
    format holds the result (written and read back), GGUF refuses the family with the reason."""
    from jgptq_torch.export.checkpoint import export_model
    from jgptq_torch.export.gguf.export import check_exportable
    from jgptq_torch.export.gguf.families import UnsupportedGGUFModel

    reference = build("glm_moe_dsa", **FSF)
    kl = {}
    for method in ("rtn", "gptq"):
        model = build("glm_moe_dsa", **FSF)
        result = jgptq.quantize_moe(model, CALIB, method=method, bits=4, group_size=16, batch_size=2, progress=False)
        assert sum(result.report.coverage["model.layers.1.mlp.experts"]) == 2 * CALIB.numel()
        kl[method] = next_token_kl(reference, model, CALIB)
    assert 0 < kl["gptq"] < kl["rtn"] < 2e-3, kl
    assert any(export_model(model, result, "gptq", tmp_path / "gptq").glob("*.safetensors"))
    with pytest.raises(UnsupportedGGUFModel, match=r"model_type 'glm_moe_dsa'\) has no GGUF exporter"):
        check_exportable(model)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("family", "stop", "settings"), [("glm_moe_dsa", 0, FSF), ("kolibri1_1", 1, {})])
def test_resumed_run_carries_the_state(tmp_path, monkeypatch, family, stop, settings):
    """A run stopped after layer ``stop`` and resumed at the next, which reads what that layer handed on (GLM-5's
    shared indexer layer 1 its top-k; Kolibri 1.1's layer 2 the pool and the keys and values of layer 1), gets the
    state from the checkpoint: the same records and weights as a run straight through."""
    run = {"method": "gptq", "bits": 4, "group_size": 16, "batch_size": 2, "progress": False}
    model = build(family, **settings)
    whole = jgptq.quantize_moe(model, CALIB, **run)
    original = resume.Checkpoint.save_layer

    class Stop(Exception):
        pass

    def save_layer(self, i, *args, **kwargs):
        original(self, i, *args, **kwargs)
        if i == stop:
            raise Stop

    monkeypatch.setattr(resume.Checkpoint, "save_layer", save_layer)
    with pytest.raises(Stop):
        jgptq.quantize_moe(build(family, **settings), CALIB, checkpoint_dir=tmp_path, **run)
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    again = build(family, **settings)
    resumed = jgptq.quantize_moe(again, CALIB, checkpoint_dir=tmp_path, **run)
    assert set(resumed.weights) == set(whole.weights)
    for key, rec in whole.weights.items():
        assert (resumed.weights[key].dequantize() == rec.dequantize()).all(), key
    sa, sb = model.state_dict(), again.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


class _Layer(nn.Module):
    def __init__(self, annotated: bool):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.annotated = annotated

    def forward(self, hidden_states, state=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(hidden_states), hidden_states.sum(-1)


class _Unannotated(_Layer):
    def forward(self, hidden_states, state=None):
        return self.proj(hidden_states), hidden_states.sum(-1)


class _Toy(nn.Module):
    """Two layers; the forward hands layer 0's second output to layer 1 (``touch``: computing on it first)."""

    def __init__(self, layer_cls, touch: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([layer_cls(True), layer_cls(True)])
        self.touch = touch

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h, state = self.embed(input_ids), None
        for layer in self.layers:
            h, state = layer(h, state=state)
            state = state * 2 if self.touch else state
        return h


@pytest.mark.parametrize(("layer_cls", "touch", "reason"), [
    (_Unannotated, False, "does not say how many"),
    (_Layer, True, "computes on a value a decoder layer returned"),
])
def test_state_that_cannot_be_carried_is_refused(layer_cls, touch, reason):
    model = _Toy(layer_cls, touch)
    batch_list = batches(token_ids(2, 4, seed=0, vocab=16), batch_size=2)
    with pytest.raises(UnsupportedModelError, match=reason):
        capture_inputs(model, model.layers, batch_list, torch.device("cpu"))


def test_toy_state_is_carried():
    """The same toy forward without computing on the state: layer 1's inputs are linked to layer 0's output."""
    model = _Toy(_Layer)
    ids = token_ids(2, 4, seed=0, vocab=16)
    with torch.no_grad():
        hidden, inputs = capture_inputs(model, model.layers, batches(ids, batch_size=2), torch.device("cpu"))
        assert inputs[0][0][1]["state"] is None
        h0 = run_layer(model.layers[0], hidden[0], *inputs[0][0])
        assert torch.equal(h0.carried[1], hidden[0].sum(-1))
        _, kw = inputs[0][1]
        assert isinstance(kw["state"], Carried) and kw["state"].index == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_float_stream_carries_its_own_state(monkeypatch):
    """With the importance statistic taken on the float model (``imatrix_source="float"``) the run carries the
    float model's stream beside its own: Kolibri 1.1's layer 2 on that stream reads the keys, values and pool float
    layer 1 made on it, not the quantized layer's, so the stream's inputs to every layer (layer 3's: layer 2's
    outputs) are the float forward's (to the capture implementation's float rounding)."""
    from jgptq_torch.pipeline import float_stream

    reference = build("kolibri1_1", **FOUR)
    want = [[] for _ in reference.model.layers]
    handles = [layer.register_forward_pre_hook(lambda m, args, i=i: want[i].append(args[0].clone()))
               for i, layer in enumerate(reference.model.layers)]
    try:
        with torch.no_grad():
            for ids in CALIB.split(2):
                reference(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    seen, replay = {}, {}
    original = float_stream.FloatStream.before_calibrate

    def before_calibrate(self, run, step):
        if step.first:
            seen[step.index], replay[step.index] = list(run.float_hidden), list(step.hidden)
        original(self, run, step)

    monkeypatch.setattr(float_stream.FloatStream, "before_calibrate", before_calibrate)
    jgptq.quantize_moe(build("kolibri1_1", **FOUR), CALIB, method="rtn", imatrix_source="float", bits=3, group_size=16,
                       batch_size=2, progress=False)
    assert sorted(seen) == [0, 1, 2, 3]
    for i in (1, 2, 3):
        for b in range(2):
            scale = float(want[i][b].abs().max())
            assert float((seen[i][b] - want[i][b]).abs().max()) < 1e-5 * scale, (i, b)
            assert float((replay[i][b] - want[i][b]).abs().max()) > 1e-3 * scale, (i, b)   # the run's own differs
