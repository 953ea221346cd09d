"""Methods as plug-ins: the registry, the dispatch of quantize_bucket, and a method added from outside the
package running through the configuration, the bucket, the records and the whole torch pipeline."""

import jax.numpy as jnp
import numpy as np
import pytest

from jgptq import methods
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq.config import PipelineConfig, QuantConfig
from jgptq.methods import rtn


class NearestWithTokens:
    """Round-to-nearest that declares a need for calibration tokens: matrices under the threshold must come back
    labelled as fallbacks, the others under this method's name."""

    name = "nearest_with_tokens"
    statistics = ("hessian",)
    token_threshold = True

    def __init__(self):
        self.seen = []

    def solve(self, bucket):
        self.seen.append((tuple(bucket.weights.shape), bucket.low, bucket.name))
        return methods.BucketOutput(rtn.nearest(bucket.weights, bucket.importance, bucket.plan.quant),
                                    fell_back={1: "chose not to"})


@pytest.fixture
def plugin():
    method = methods.register(NearestWithTokens())
    yield method
    methods.unregister(method.name)


def _stacks(rng, tokens):
    w = jnp.asarray(rng.standard_normal((len(tokens), 8, 64)), jnp.float32)
    x = rng.standard_normal((256, 64))
    h = jnp.asarray(np.broadcast_to(x.T @ x / 256, (len(tokens), 64, 64)), jnp.float32)
    return [Stack("experts.down_proj", w, h, tokens)]


def test_builtin_methods_are_known_and_unknown_ones_are_refused_by_name():
    assert methods.names()[:2] == ("gptq", "rtn")
    assert methods.get("gptq").statistics == ("hessian",) and methods.get("gptq").token_threshold
    assert methods.get("rtn").statistics == () and not methods.get("rtn").token_threshold
    with pytest.raises(ValueError, match=r"unknown quantization method 'smoothquant'; known methods: \['gptq', 'rtn'"):
        methods.get("smoothquant")
    with pytest.raises(ValueError, match="PipelineConfig.method='smoothquant': must be one of"):
        PipelineConfig(method="smoothquant")
    with pytest.raises(ValueError, match="already registered"):
        methods.register(methods.get("rtn"))
    with pytest.raises(ValueError, match="lacks"):
        methods.register(object())


def test_a_registered_method_solves_its_buckets_with_the_shared_fallbacks(plugin):
    rng = np.random.default_rng(0)
    quant = QuantConfig(bits=4, group_size=32)
    stacks = _stacks(rng, [500, 500, 3, 500])
    (solved,) = quantize_bucket(stacks, MatrixPlan(plugin.name, quant), threshold=10)
    assert plugin.seen == [((4, 8, 64), (False, False, True, False), "experts.down_proj (8x64)")]
    assert solved.method == ("nearest_with_tokens", "rtn", "rtn", "nearest_with_tokens")
    assert solved.reason == ("", "chose not to", "3 tokens < 10", "")
    (reference,) = quantize_bucket(stacks, MatrixPlan("rtn", quant))
    np.testing.assert_array_equal(np.asarray(solved.weight), np.asarray(reference.weight))
    np.testing.assert_array_equal(np.asarray(solved.codes), np.asarray(reference.codes))
    record = solved.record()
    assert record.method == "mixed" and solved.record(0).method == "nearest_with_tokens"
    assert PipelineConfig(method=plugin.name).method == plugin.name


def test_the_statistics_a_method_declares_must_be_collected(plugin):
    from jgptq import statistics

    assert list(statistics.of_config(PipelineConfig(method=plugin.name))) == ["hessian", "imatrix"]
    plugin.statistics = ("hessian", "activation_means")
    with pytest.raises(ValueError, match=r"method 'nearest_with_tokens' reads the statistics \['activation_means'\], "
                                         r"which the pipeline does not collect"):
        statistics.of_config(PipelineConfig(method=plugin.name))


def test_a_registered_method_runs_through_the_torch_pipeline(plugin):
    torch = pytest.importorskip("torch")
    import jgptq
    from tests.tiny_models import build

    model = build("qwen3_moe")
    calib = torch.randint(0, model.config.vocab_size, (4, 32))
    result = jgptq.quantize_moe(model, calib, method=plugin.name, bits=4, group_size=32, progress=False)
    labels = {r.method for r in result.report.records}
    assert plugin.name in labels and labels <= {plugin.name, "rtn"}
    assert plugin.seen   # every bucket of the run went through the plug-in
    assert {rec.method for rec in result.weights.values()} <= {plugin.name, "rtn", "mixed"}
