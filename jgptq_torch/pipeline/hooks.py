"""The hooks around the layer step of :func:`jgptq_torch.pipeline.layerwise.quantize_moe`
(:mod:`jgptq_torch.pipeline.step` says when each point is called): :class:`Offload` (where the layers live:
:class:`jgptq_torch.pipeline.offload.Placement`), :class:`Resume` (the state of a resumable run:
:mod:`jgptq_torch.pipeline.resume`), :class:`WarmUp` (a new layer's solve programs compiled beside its
calibration) and :class:`Sink` (the records written out as the run goes). The float model's stream is
:class:`jgptq_torch.pipeline.float_stream.FloatStream`.
"""

from __future__ import annotations

import sys
import time
import warnings

from jgptq.surface import option
from jgptq import statistics as stats_mod
from jgptq_torch.pipeline import (
    expert_chunks,
    float_stream,
    importance,
    routed_groups,
    warm_groups,
    weight_checks,
)
from jgptq_torch.pipeline import offload as offload_mod
from jgptq_torch.pipeline import resume as resume_mod
from jgptq_torch.pipeline.solve import Warming, solve_buckets, warm_solves, warm_wanted
from jgptq_torch.pipeline.step import Hook, LayerStep

SINK_SWITCH_INTERVAL = 5e-4   # seconds: Python's thread switch interval while a sink writes beside the run


class Offload(Hook):
    """The layers' places (``run.placement``): put in place before the first layer, each layer fetched to the
    device before its step and put back after it (timed as the ``offload`` stage when the mode moves layers),
    the activations checked against the device budget once captured (and its chunks of routed experts said), the
    placement ended with the run."""

    def start(self, run, first: int) -> None:
        if first < len(run.layers):
            run.placement.prepare()

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        extra = 0 if run.float_hidden is None else offload_mod.nbytes(hidden)   # the float stream's own set
        run.placement.check_activations(offload_mod.captured_bytes(hidden, layer_inputs, run.device) + extra)
        expert_chunks.say_plan(run.placement, run.cfg.progress)
        return hidden

    def before_layer(self, run, i: int) -> None:
        _timed_move(run, i, run.placement.fetch)
        if run.placement.source is not None:   # a streamed layer's weights exist only now: NaN/Inf named before work
            weight_checks.check_finite_weights(run.targets[i:i + 1], run.prefix, first=i)

    def after_layer(self, run, i: int, hidden) -> None:
        _timed_move(run, i, run.placement.put_back)

    def close(self, run, error) -> None:
        note = run.placement.failure_note() if error is not None else ""
        if note:
            error.add_note(note)
        end_placement(run.placement, error is not None)
        run.report.memory.update(run.placement.memory)


def end_placement(placement, failed: bool) -> None:
    """Ends ``placement`` (:class:`jgptq_torch.pipeline.offload.Placement`) as a run stops; after a failure, an
    error of its own is only warned about (the run's error stands)."""
    if not failed:
        placement.finish(False)
        return
    try:
        placement.finish(True)
    except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
        warnings.warn(f"after the run's error, the offloaded layers could not be loaded back ({exc}); "
                      f"{placement.memory.get('offload_dir', '')} holds them", stacklevel=3)


def _timed_move(run, i: int, move) -> None:
    t0 = time.perf_counter()
    move(i)
    if run.placement.moves:
        run.report.add_time(i, "offload", time.perf_counter() - t0)


class WarmUp(Hook):
    """A pass of buckets not seen before (a layer's, or a chunk's of its routed experts; a shape or a plan, such
    as a mix's format, not met yet): its solve programs (GGML ones with their guard and decode) compile on worker
    threads beside its calibration (:func:`jgptq_torch.pipeline.solve.warm_solves`), joined before its solve,
    whose compiles are then found done.

    On an accelerator, a pass whose routed experts' group programs were not listed before also starts their
    compiles (:mod:`jgptq_torch.pipeline.warm_groups`, at most
    :data:`jgptq_torch.pipeline.warm_groups.MAX_GROUP_PROGRAMS` a run): they run on beside the calibration and
    the solve and the next layers (whose calibration waits for a program under way and compiles one not started
    itself), and stop when the run ends.

    A pass of a chunk of routed experts compiles nothing ahead: the chunks were planned to fill the device's free
    memory, and a compile on a worker thread measures its candidate kernels on buffers of its program's size
    (XLA's autotuning on a GPU: 12 GB for a 64-slot group of 7168-wide Hessians), which found no room there and
    ended the process on an 80 GB GPU. Those passes' programs compile where the solve and the calibration meet
    them, one at a time."""

    def __init__(self):
        self.warmed: set = set()
        self.warming = None
        self.grouped: set = set()
        self.group_warmings: list = []
        self.group_left = warm_groups.MAX_GROUP_PROGRAMS

    def before_calibrate(self, run, step: LayerStep) -> None:
        if step.span is not None:     # memory planned full: no compile beside the pass
            return
        step.stage("compile")
        self._warm_groups(run, step)
        chunk = None if step.span is None else step.span[1] - step.span[0]
        base = f"{run.prefix}.{step.index}"
        buckets = solve_buckets(step.target, base, run.plan, chunk)
        if buckets <= self.warmed:
            return
        self.warmed.update(buckets)
        self.warming = warm_solves(step.target, base, run.plan, run.cfg, devices=run.devices, chunk=chunk)

    def _warm_groups(self, run, step: LayerStep) -> None:
        if self.group_left <= 0 or not routed_groups.accelerator(run.device) or not warm_wanted(run.devices):
            return
        chain = run.stats
        dtype = step.hidden[0].dtype if step.hidden else None
        keys = warm_groups.group_keys(step.target, step.span, chain, dtype)
        if dtype is None or keys <= self.grouped:
            return
        self.grouped.update(keys)
        jobs = warm_groups.group_jobs(step.target, step.span, chain, dtype, run.device,
                                      warm_groups.tokens_per_forward(step.hidden),
                                      warm_groups.top_k_of(run.result.model), limit=self.group_left)
        if jobs:
            self.group_left -= len(jobs)
            self.group_warmings.append(Warming(jobs, run.devices, workers=warm_groups.WORKERS))

    def before_solve(self, run, step: LayerStep) -> None:
        if self.warming is not None:
            self.warming.join()
            self.warming = None

    def close(self, run, error) -> None:
        for warming in self.group_warmings:
            warming.join()
        self.group_warmings = []


class Sink(Hook):
    """A ``sink=`` of ``quantize_moe`` (a GGUF file or a checkpoint folder written as the layers finish): started
    before the first layer with the records restored so far, handed each layer's records by the stores' worker
    (:class:`jgptq_torch.pipeline.stores.Stores`), finished when every layer is done (its time the report's
    ``export`` stage), aborted when the run fails.

    A sink that ``releases_records`` writes them as they come: the run does not keep them, unless a resumable
    run (``checkpointed``) saves each layer's first (:class:`Resume` drops them after).
    """

    def __init__(self, sink, checkpointed: bool):
        self.sink, self.checkpointed = sink, checkpointed
        self.interval = None

    def start(self, run, first: int) -> None:
        self.interval = sys.getswitchinterval()
        self.sink.start(run.result.model, run.result)
        run.stores.sink = self.sink
        run.stores.keep_records = self.checkpointed or not getattr(self.sink, "releases_records", False)
        # The writer thread holds Python's lock between its file writes; at the default 5 ms switch interval each
        # of the many short waits of the thread that drives the GPU could cost up to 5 ms (on the H200, 0.06 s a
        # layer of a 30B MoE model's solve).
        sys.setswitchinterval(min(self.interval, SINK_SWITCH_INTERVAL))

    def finish(self, run) -> None:
        t0 = time.perf_counter()
        self.sink.finish(run.result)
        run.report.add_time(max(len(run.layers) - 1, 0), "export", time.perf_counter() - t0)
        if getattr(self.sink, "busy_s", None) is not None:   # a writer thread: how long it worked beside the run
            run.report.memory["writer_busy_s"] = self.sink.busy_s

    def close(self, run, error) -> None:
        if error is not None:
            self.sink.abort()
        if self.interval is not None:
            sys.setswitchinterval(self.interval)


class Resume(Hook):
    """The state of a resumable run (:class:`jgptq_torch.pipeline.resume.Checkpoint` in ``checkpoint_dir``):
    :meth:`open` takes the finished layers over; the next layer starts from the stored inputs (and the float
    stream's, when the run carries it); after each layer its records, report part, importance statistic and the
    next layer's inputs are saved."""

    def __init__(self, ckpt, done: int):
        self.ckpt, self.done = ckpt, done
        self.marks, self.before = (0, 0), set()

    @classmethod
    def open(cls, run, checkpoint_dir, resume: bool, source=None) -> Resume:
        """Opens the state in ``checkpoint_dir`` for ``run`` (refusing the state of another run, or starting
        over with ``resume=False``) and restores its finished layers into ``run.result`` and the model."""
        digest = source.source.fingerprint() if source is not None else None
        ckpt = resume_mod.Checkpoint(checkpoint_dir, resume_mod.fingerprint(
            run.result.model, run.batch_list, run.cfg, len(run.layers), imatrix=run.given, model_digest=digest),
            resume=resume)
        done = ckpt.open()
        if done and run.cfg.progress:   # said once the state is known to match, never before a refusal
            print(f"jgptq: continuing the run whose state is in {checkpoint_dir} ({done} layers done; "
                  f"{option('no_resume')} starts over)", file=sys.stderr, flush=True)
        for i in range(done):
            resume_mod.restore_layer(ckpt, i, run.targets[i], run.prefix, run.names, run.result)
        return cls(ckpt, done)

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        if not first:
            return hidden
        hidden = self.ckpt.load_hidden(first, run.device)
        if float_stream.enabled(run.cfg, run.given, run.stats):
            run.float_hidden = self.ckpt.load_hidden(first, run.device, stream="float")
        return hidden

    def before_layer(self, run, i: int) -> None:
        self.marks, self.before = (len(run.report.records), len(run.report.warnings)), set(run.result.weights)

    def after_layer(self, run, i: int, hidden) -> None:
        report, last = run.report, i == len(run.layers) - 1
        run.stores.collect(run.result.weights, report)
        self.ckpt.save_layer(i, {k: v for k, v in run.result.weights.items() if k not in self.before},
                             resume_mod.report_part(report, i, run.prefix, self.marks), None if last else hidden,
                             importance.layer_entries(run.result.imatrix, run.prefix, i, run.targets[i]),
                             None if last else run.float_hidden)
        if getattr(run.stores.sink, "releases_records", False):
            run.result.weights.clear()      # in the resume state and handed to the sink: not kept in memory
