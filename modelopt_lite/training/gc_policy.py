"""Garbage-collector policy for training loops.

A model, its optimizer state and its quantizers are millions of tracked objects that never die during
training; every full collection walks all of them. The policy:

* ``before_step()``: ``gc.collect()`` before each training step (so garbage from the previous step does not
  pile up until Python's thresholds trigger a collection in the middle of a step);
* ``after_optimizer_step()``: after the first optimizer step, ``gc.freeze()`` once: everything alive then
  (model, optimizer state, quantizers) moves to the permanent generation, and later collections skip it;
* with ``refreeze_every=N``: every N steps ``gc.unfreeze()``, collect, ``gc.freeze()`` again, so that a
  cycle created transiently during training is never pinned for the whole run;
* ``evaluation_step()``: collect without freezing;
* ``close()``: ``gc.unfreeze()`` only if this policy froze (it tracks its own freeze instead of reading
  ``gc.get_freeze_count()``, which also counts objects frozen before training). Call it in ``finally``.
"""

from __future__ import annotations

import gc
import logging
import time

from ..logging import get_logger

__all__ = ["GCPolicy"]

logger = get_logger(__name__)


class GCPolicy:
    def __init__(self, enabled: bool = True, refreeze_every: int | None = None):
        if refreeze_every is not None and (isinstance(refreeze_every, bool) or int(refreeze_every) < 1):
            raise ValueError(
                f"gc_refreeze_every={refreeze_every!r} must be a positive number of steps or None"
            )
        self.enabled = enabled
        self.refreeze_every = None if refreeze_every is None else int(refreeze_every)
        self.frozen = False
        self.optimizer_steps = 0
        self.collect_seconds = 0.0

    def _collect(self) -> None:
        start = time.perf_counter()
        gc.collect()
        self.collect_seconds += time.perf_counter() - start

    def before_step(self) -> None:
        if self.enabled:
            self._collect()

    def after_optimizer_step(self) -> None:
        if not self.enabled:
            return
        self.optimizer_steps += 1
        if not self.frozen:
            gc.freeze()
            self.frozen = True
            if logger.isEnabledFor(logging.DEBUG):  # get_freeze_count() walks every frozen object
                logger.debug("gc.freeze() after optimizer step %d: %d objects frozen", self.optimizer_steps,
                             gc.get_freeze_count())  # fmt: skip
        elif self.refreeze_every and self.optimizer_steps % self.refreeze_every == 0:
            gc.unfreeze()
            self._collect()
            gc.freeze()

    def evaluation_step(self) -> None:
        if self.enabled:
            self._collect()

    def close(self) -> None:
        """Unfreeze if this policy froze; safe to call twice (and after an error)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
