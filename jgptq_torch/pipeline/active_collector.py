"""The collector that the capture implementations report to while a block runs: set by
:meth:`jgptq_torch.pipeline.capture.Collector.attach`, read by the experts forward
(:mod:`jgptq_torch.pipeline.experts_capture`) and the captures of experts that transformers does not dispatch
(:mod:`~jgptq_torch.pipeline.prescaled_capture`, :mod:`~jgptq_torch.pipeline.stacked_capture`,
:mod:`~jgptq_torch.pipeline.row_capture`). None: a plain forward."""

import contextvars

ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jgptq_collector", default=None)
