"""The exporters' per-record work (packing codes, converting scales) on a few threads, results kept in order.

:func:`ordered_results` runs zero-argument jobs on a thread pool and yields their results in the jobs' order, with at
most ``lookahead`` jobs taken from the input and not yet handed on: the memory held beside the consumer is bounded
by ``lookahead`` records' tensors, whatever the number of records. numpy releases the GIL in its array kernels, so
the workers pack side by side and leave the interpreter to the threads that launch device work.

Errors keep the order of a plain loop: a job's exception, or one raised by the input iterator while taking the next
job, is raised where the loop would have met it, after every earlier job's result was handed on; nothing after it is
taken from the input. With one worker the jobs run in the consumer's thread, one at a time (no pool).

Example::

    for tensors in ordered_results((functools.partial(pack, r) for r in records), workers=4):
        write(tensors)
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional

MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """Workers when none are asked for: half the host's cores (the rest run the model and read the checkpoint),
    at least 1 and at most :data:`MAX_DEFAULT_WORKERS`."""
    return max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) // 2))


def check_workers(workers: Optional[int]) -> int:
    """``workers`` as a positive int (None: :func:`default_workers`); ValueError for anything else."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer (or None for {default_workers()} here)")
    return workers


class _Raise:
    """An error from the input iterator, raised when the consumer reaches its place."""

    def __init__(self, error: BaseException):
        self.error = error


def ordered_results(jobs: Iterable[Callable[[], object]], workers: Optional[int] = None,
                    lookahead: Optional[int] = None) -> Iterator[object]:
    """The results of ``jobs`` (zero-argument callables, taken lazily from the iterable), in order.

    Args:
      jobs: the work, one callable per result.
      workers: threads running jobs (None: :func:`default_workers`); 1 runs each job in the consumer's thread.
      lookahead: most jobs taken from ``jobs`` and not yet yielded (default ``2 * workers``); at least ``workers``.
    Yields:
      each job's return value, in the order of ``jobs``.
    """
    workers = check_workers(workers)
    if workers == 1:
        for job in jobs:
            yield job()
        return
    lookahead = 2 * workers if lookahead is None else lookahead
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < workers:
        raise ValueError(f"lookahead={lookahead!r} must be an integer of at least workers={workers}")
    source = iter(jobs)
    pending: collections.deque = collections.deque()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jgptq-export")
    taking = True
    try:
        while True:
            while pending and not isinstance(pending[0], _Raise) and pending[0].done():
                yield pending.popleft().result()          # finished work first: it leaves memory soonest
            if taking and len(pending) < lookahead:
                try:
                    job = next(source)
                except StopIteration:
                    taking = False
                except Exception as exc:  # noqa: BLE001 - raised in order, below
                    pending.append(_Raise(exc))
                    taking = False
                else:
                    pending.append(pool.submit(job))
                continue
            if not pending:
                return
            head = pending.popleft()
            if isinstance(head, _Raise):
                raise head.error
            yield head.result()
    finally:
        for item in pending:
            if not isinstance(item, _Raise):
                item.cancel()
        pool.shutdown(wait=True)
