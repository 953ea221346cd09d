"""Progress of a run that suits a terminal and a log file alike.

On a terminal (stderr is a TTY) the layers get a tqdm bar whose postfix names the stage in progress
(``layer 3 solve``), and each stage's batches a transient bar under it. Anywhere else (stderr redirected to a
file or a pipe) nothing is redrawn: the layer loop writes one line per finished layer and the stage bars are off.

- :func:`stage_bar`: an iterable, wrapped in a transient tqdm bar on a terminal only.
- :class:`LayerProgress`: iterates layer indices; :meth:`LayerProgress.stage` names the stage in progress.
"""

from __future__ import annotations

import sys
import time

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional
    tqdm = None

__all__ = ["stage_bar", "LayerProgress", "on_terminal"]


def on_terminal() -> bool:
    """True when stderr (where progress goes) is an interactive terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def stage_bar(iterable, *, desc: str, enabled: bool = True):
    """``iterable`` in a transient tqdm bar titled ``desc`` when ``enabled`` and on a terminal, else as it is."""
    if not enabled or tqdm is None or not on_terminal():
        return iterable
    return tqdm(iterable, desc=desc, leave=False)


class LayerProgress:
    """Iterates ``range(start, n)``: a tqdm bar on a terminal, one stderr line per finished layer elsewhere.

    Args:
      start: the first layer to run (earlier ones were done by a resumed run).
      n: the number of layers.
      enabled: False shows nothing.
      desc: the bar's title and the lines' prefix.
      eta: the lines also say about how long the layers left take, at the mean time of the layers so far.
      slow_stage_s: in a log (not a terminal), a stage that took at least this many seconds gets a line of its own
        when the next one begins, so that a long layer is not silent; quick stages stay out of the log.
    """

    def __init__(self, start: int, n: int, *, enabled: bool = True, desc: str = "jgptq layers", eta: bool = False,
                 slow_stage_s: float = 10.0):
        self.start, self.n, self.enabled, self.desc, self.eta = start, n, enabled, desc, eta
        self.slow_stage_s = slow_stage_s
        self.layer = start
        self._bar = None
        self._stage = None   # (name, start time) of the stage in progress
        if enabled and tqdm is not None and on_terminal():
            self._bar = tqdm(total=n, initial=start, desc=desc)

    def __iter__(self):
        begun = time.perf_counter()
        try:
            for i in range(self.start, self.n):
                self.layer, t0 = i, time.perf_counter()
                self._stage = None
                yield i
                if self._bar is not None:
                    self._bar.update(1)
                elif self.enabled:
                    now = time.perf_counter()
                    left = (now - begun) / (i + 1 - self.start) * (self.n - i - 1)
                    tail = f", about {left:.0f} s left" if self.eta and i + 1 < self.n else ""
                    print(f"{self.desc}: {i + 1}/{self.n} (layer {i} in {now - t0:.1f} s{tail})",
                          file=sys.stderr, flush=True)
        finally:
            if self._bar is not None:
                self._bar.set_postfix_str("")
                self._bar.close()

    def stage(self, name: str) -> None:
        """Shows ``layer <i> <name>`` beside the bar on a terminal. In a log, writes a line when the stage that
        ends here took ``slow_stage_s`` or more."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"layer {self.layer} {name}")
            return
        now = time.perf_counter()
        if self.enabled and self._stage is not None and now - self._stage[1] >= self.slow_stage_s:
            print(f"{self.desc}: layer {self.layer} {self._stage[0]} took {now - self._stage[1]:.1f} s, {name} "
                  f"next", file=sys.stderr, flush=True)
        self._stage = (name, now)
