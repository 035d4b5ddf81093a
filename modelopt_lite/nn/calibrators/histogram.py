"""The histogram calibrator: a histogram of ``|x|`` (per tensor) whose amax is picked at a percentile of it,
as the one minimising the expected fake-quantization MSE over the histogram, or (INT formats) as the one
minimising the KL divergence between the histogram and its quantized form ("entropy"); and
:func:`make_calibrator`, a calibrator by name.
"""

from __future__ import annotations

from typing import Literal

import torch

from ...formats import FormatSpec, fake_quant_reference
from ..errors import UnsupportedFeatureError
from .base import Calibrator, MaxCalibrator, _check_finite

__all__ = ["HistogramCalibrator", "make_calibrator"]

_HISTOGRAM_METHODS = ("percentile", "mse", "entropy")


class HistogramCalibrator(Calibrator):
    """Histogram of ``|x|`` (per-tensor INT / FP8 specs) with a percentile, MSE or entropy amax choice.

    The reference's arguments ``(num_bits, axis, unsigned, num_bins, grow_method, skip_zeros, torch_hist)``:
    ``skip_zeros=True`` leaves exact zeros out of the histogram; ``grow_method`` (deprecated there and
    unused) and ``torch_hist`` (the histogram is always computed with torch here) are accepted and change
    nothing. Ours, keyword-only: ``method`` is the default of :meth:`compute_amax`, which also takes one as
    the reference's does (``compute_amax("entropy", stride=1, start_bin=128)``), and ``percentile``."""

    def __init__(
        self,
        num_bits: FormatSpec | int | tuple[int, int] = 8,
        axis: int | tuple[int, ...] | str | None = None,
        unsigned: bool = False,
        num_bins: int = 2048,
        grow_method: str | None = None,
        skip_zeros: bool = False,
        torch_hist: bool = True,
        *,
        method: Literal["percentile", "mse", "entropy"] = "percentile",
        percentile: float = 99.99,
        owner: str | None = None,
    ):
        super().__init__(num_bits, axis, unsigned, owner=owner)
        spec, owner = self.spec, self.owner
        if spec.kind not in ("int", "fp8") or spec.axis is not None or spec.block_axes:
            raise UnsupportedFeatureError(
                f"{owner}: calibrator '{method}' supports per-tensor INT / FP8 quantizers only, "
                f"not {spec.name} {spec.granularity}; use calibrator='max'"
            )
        self._check_method(method)
        self._check_percentile(percentile)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"{owner}: num_bins={num_bins!r} must be an integer of at least 2")
        if grow_method is not None and not isinstance(grow_method, str):
            raise TypeError(f"{owner}: grow_method={grow_method!r} must be a string or None (it is unused)")
        for flag, value in (("skip_zeros", skip_zeros), ("torch_hist", torch_hist)):
            if not isinstance(value, bool):
                raise TypeError(f"{owner}: {flag}={value!r} must be True or False")
        self.method = method
        self.percentile = percentile
        self.num_bins = num_bins
        self.skip_zeros = skip_zeros
        self._hist: torch.Tensor | None = None  # float64 counts over [0, _range]
        self._range = 0.0

    def collect(self, x: torch.Tensor) -> None:
        mag = x.detach().abs().float().flatten()
        _check_finite(mag, self.owner)
        if self.skip_zeros:
            mag = mag[mag != 0]
        batch_max = float(mag.max()) if mag.numel() else 0.0
        if self._hist is None:
            self._range = batch_max if batch_max > 0 else 1.0
            self._hist = torch.zeros(self.num_bins, dtype=torch.float64)
        elif batch_max > self._range:
            self._rebin(batch_max)
        counts = torch.histc(mag.cpu(), bins=self.num_bins, min=0.0, max=self._range)
        self._hist += counts.double()
        self.num_batches += 1

    def _rebin(self, new_range: float) -> None:
        if self._hist is None:
            return
        # Move the old counts into the wider bins by their centres (a count never leaves the histogram).
        width = self._range / self.num_bins
        centres = (torch.arange(self.num_bins, dtype=torch.float64) + 0.5) * width
        idx = (centres / new_range * self.num_bins).long().clamp_(max=self.num_bins - 1)
        hist = torch.zeros(self.num_bins, dtype=torch.float64)
        hist.index_add_(0, idx, self._hist)
        self._hist, self._range = hist, new_range

    def _check_method(self, method: str) -> None:
        if method not in _HISTOGRAM_METHODS:
            raise ValueError(f"{self.owner}: calibration method {method!r} (allowed: {_HISTOGRAM_METHODS})")
        if method == "entropy" and self.spec.kind != "int":
            raise ValueError(f"{self.owner}: the entropy method needs an INT format, not {self.spec.name}")

    def _check_percentile(self, percentile: float) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"{self.owner}: percentile={percentile} must be in (0, 100]")

    def compute_amax(
        self,
        method: Literal["percentile", "mse", "entropy"] | None = None,
        *,
        stride: int = 1,
        start_bin: int = 128,
        percentile: float | None = None,
    ) -> torch.Tensor | None:
        """The amax by ``method`` (default: the constructor's); ``stride`` and ``start_bin`` are the
        entropy search's (the reference's defaults), ``percentile`` replaces the constructor's."""
        method = self.method if method is None else method
        self._check_method(method)
        if self._hist is None:
            return None
        edges = torch.linspace(0.0, self._range, self.num_bins + 1, dtype=torch.float64)
        if method == "percentile":
            percentile = self.percentile if percentile is None else percentile
            self._check_percentile(percentile)
            cdf = torch.cumsum(self._hist, 0) / self._hist.sum()
            idx = int(torch.searchsorted(cdf, torch.tensor(percentile / 100.0, dtype=cdf.dtype)))
            return edges[min(idx + 1, self.num_bins)].float()
        if method == "entropy":
            return self._entropy_amax(edges, stride, start_bin)
        return self._mse_amax(edges)

    def _entropy_amax(self, edges: torch.Tensor, stride: int, start_bin: int) -> torch.Tensor:
        """The reference's KL search: for each candidate of ``i`` bins (``start_bin`` to all, by ``stride``),
        the reference distribution is the first ``i`` bins with the clipped tail added to the last, and the
        candidate spreads each of the ``2**(num_bits - 1)`` (unsigned: ``2**num_bits``) quantization
        levels' count evenly over its non-empty bins; the amax is the upper edge of the last candidate with
        the smallest KL divergence. The first bin (mostly exact zeros) counts as the second. Candidates whose
        bins hold no data are never chosen (the reference picks one when the first ``start_bin`` bins are
        empty)."""
        if stride < 1 or not 1 <= start_bin <= self.num_bins:
            raise ValueError(
                f"{self.owner}: entropy search needs stride >= 1 and 1 <= start_bin <= num_bins "
                f"({self.num_bins}); got stride={stride}, start_bin={start_bin}"
            )
        hist = self._hist.clone()
        hist[0] = hist[1]
        levels = 1 << (self.spec.num_bits - 1 + int(self.spec.unsigned))
        tail = hist.flip(0).cumsum(0).flip(0)  # tail[i] = sum(hist[i:])
        best, best_kl = start_bin, float("inf")
        for i in range(start_bin, self.num_bins + 1, stride):
            p = hist[:i].clone()
            if i < self.num_bins:
                p[-1] += tail[i]
            bounds = torch.arange(levels + 1, dtype=torch.float64) * (i / levels)  # numpy.linspace(0, i)
            bounds[-1] = i
            level = torch.bucketize(torch.arange(i, dtype=torch.float64), bounds, right=True) - 1
            used = hist[:i] != 0
            total = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, hist[:i])
            count = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, used.double())
            q = torch.where(used, total[level] / count[level].clamp(min=1), 0.0)
            kl = _kl_divergence(p, q)
            if kl <= best_kl:  # the last of equal minima, as the reference
                best, best_kl = i, kl
        return edges[best].float()

    def _mse_amax(self, edges: torch.Tensor) -> torch.Tensor:
        centres = ((edges[:-1] + edges[1:]) / 2).float()
        start = self.num_bins // 8
        candidates = edges[start + 1 :: max(1, self.num_bins // 512)].float().reshape(-1, 1)
        errors = []
        for chunk in candidates.split(64):
            q = fake_quant_reference(centres.expand(chunk.shape[0], -1), self.spec, chunk)
            errors.append((((q - centres) ** 2).double() * self._hist).sum(dim=1))
        best = int(torch.argmin(torch.cat(errors)))
        return candidates[best, 0].clone()

    def reset(self) -> None:
        super().reset()
        self._hist, self._range = None, 0.0


def _kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    """``sum(p log(p / q))`` of the normalized counts; ``inf`` where ``q`` is 0 and ``p`` is not, or where
    ``q`` holds no count at all (the reference's NaN there wins its argmin: a candidate keeping no data)."""
    if not bool(q.sum() > 0):
        return float("inf")
    p, q = p / p.sum(), q / q.sum()
    nz = p > 0
    if bool((q[nz] == 0).any()):
        return float("inf")
    return float((p[nz] * torch.log(p[nz] / q[nz])).sum())


def make_calibrator(name: str, spec: FormatSpec, owner: str, **options) -> Calibrator:
    """``"max"``, ``"percentile"``, ``"mse"`` or ``"entropy"`` (``"histogram"``, the reference's name: a
    histogram whose amax method :meth:`TensorQuantizer.load_calib_amax` names, percentile by default)."""
    if name == "max":
        return MaxCalibrator(spec, owner=owner)
    if name in _HISTOGRAM_METHODS:
        return HistogramCalibrator(spec, owner=owner, method=name, **options)
    if name == "histogram":
        return HistogramCalibrator(spec, owner=owner, **options)
    raise ValueError(
        f"{owner}: calibrator={name!r} (allowed: {('max', 'histogram', *_HISTOGRAM_METHODS)}, or a "
        "calibrator class with its arguments: (MyCalibrator, args, kwargs))"
    )
