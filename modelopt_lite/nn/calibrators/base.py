"""Calibrators: collect statistics of a quantizer's input and turn them into an amax.

* :class:`MaxCalibrator` keeps the running max of ``|x|`` over the reduce axes of the quantizer's spec
  (a scalar per tensor, ``keepdim`` per channel, one value per static block).
* :class:`HistogramCalibrator` keeps a histogram of ``|x|`` (per tensor) and picks the amax at a
  percentile of it, the one minimising the expected fake-quantization MSE over the histogram, or (INT
  formats) the one minimising the KL divergence between the histogram and its quantized form ("entropy").
* :class:`BiasCalibrator` computes an affine quantizer's bias (its ``bias`` attribute): the mean of ``x``
  over the bias axes (running mean of the per-batch means), or the midpoint of its running max and min.

Non-finite input raises: a NaN or inf reaching calibration would otherwise become a NaN scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from ...distributed import all_reduce_max, is_distributed
from ...formats import FormatSpec, fake_quant_reference, reduce_amax, resolve_format
from ..errors import UnsupportedFeatureError

__all__ = [
    "BiasCalibrator",
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "ShapeChangedError",
    "bias_settings",
    "make_calibrator",
    "sync_calibrators",
]


def _check_finite(x: torch.Tensor, owner: str) -> None:
    if not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"{owner}: {n_bad} NaN / inf value(s) reached calibration (input shape {tuple(x.shape)}); "
            "fix the model's numerics or exclude this quantizer from calibration"
        )


def _spec_of(spec_or_bits: FormatSpec | int | tuple[int, int], axis: Any, unsigned: bool) -> FormatSpec:
    """Our form passes a :class:`FormatSpec`; the reference's passes ``num_bits, axis, unsigned``."""
    if isinstance(spec_or_bits, FormatSpec):
        return spec_or_bits
    return resolve_format(spec_or_bits, axis, None, unsigned, False)


def _owner_and_axis(spec: Any, axis: Any, owner: str | None) -> tuple[str, Any]:
    """The second positional argument is the reference's ``axis``; after a :class:`FormatSpec` (which holds
    its axis) a string there is our quantizer name (``MaxCalibrator(spec, "layers.0.input_quantizer")``)."""
    if isinstance(spec, FormatSpec) and isinstance(axis, str):
        if owner is not None:
            raise TypeError("give the quantizer name once: as the second argument or as owner=")
        return axis, None
    if isinstance(spec, FormatSpec) and axis is not None:
        raise TypeError(
            f"a FormatSpec holds its own axis ({spec.granularity}); axis={axis!r} is for the reference's "
            "form Calibrator(num_bits, axis, unsigned)"
        )
    return owner if owner is not None else "TensorQuantizer", axis


class Calibrator:
    """Base class: ``collect`` batches, then ``compute_amax``; ``reset`` to start over.

    Constructed as in the reference library, ``MaxCalibrator(num_bits, axis, unsigned)`` (e.g.
    ``MaxCalibrator(8, None, False)``, ``MaxCalibrator(8, 0)``), or with a :class:`FormatSpec` and the name of
    the quantizer it serves (``MaxCalibrator(spec, "layers.0.q_proj.input_quantizer")``). Subclass it (or a
    calibrator below) for a calibrator of your own and give it in a quantizer's ``calibrator`` attribute as
    ``(MyCalibrator, args)`` or ``(MyCalibrator, args, kwargs)``."""

    def __init__(
        self,
        num_bits: FormatSpec | int | tuple[int, int] = 8,
        axis: int | tuple[int, ...] | str | None = None,
        unsigned: bool = False,
        *,
        owner: str | None = None,
    ):
        owner, axis = _owner_and_axis(num_bits, axis, owner)
        if not isinstance(unsigned, bool):
            raise TypeError(f"unsigned={unsigned!r} must be True or False")
        self.spec = _spec_of(num_bits, axis, unsigned)
        self.owner = owner
        self.num_batches = 0

    # The reference's attribute names of the same facts.
    @property
    def _num_bits(self) -> int | tuple[int, int]:
        return self.spec.num_bits

    @property
    def _axis(self) -> int | tuple[int, ...] | None:
        return self.spec.axis

    @property
    def _unsigned(self) -> bool:
        return self.spec.unsigned

    def collect(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def compute_amax(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        raise NotImplementedError

    def reset(self) -> None:
        self.num_batches = 0


class ShapeChangedError(RuntimeError, ValueError):
    """A calibration batch whose amax has another shape than the earlier ones' (a ``RuntimeError`` as in the
    reference, and a ``ValueError`` as a bad input)."""


class MaxCalibrator(Calibrator):
    """Running max of ``|x|`` with the amax shape the spec stores. ``track_amax=True`` also keeps every
    batch's amax (``amaxs``: a list of numpy arrays, as in the reference)."""

    def __init__(
        self,
        num_bits: FormatSpec | int | tuple[int, int] = 8,
        axis: int | tuple[int, ...] | str | None = None,
        unsigned: bool = False,
        track_amax: bool = False,
        *,
        owner: str | None = None,
    ):
        super().__init__(num_bits, axis, unsigned, owner=owner)
        if not isinstance(track_amax, bool):
            raise TypeError(f"track_amax={track_amax!r} must be True or False")
        self._track_amax = track_amax
        self._amaxs: list[Any] = []
        self._calib_amax: torch.Tensor | None = None

    @property
    def amaxs(self) -> list[Any]:
        """Each collected batch's amax as a numpy array (``track_amax=True``)."""
        if not self._track_amax:
            raise AttributeError(f"{self.owner}: amaxs are kept only with MaxCalibrator(track_amax=True)")
        return self._amaxs

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach()
        amax = reduce_amax(x, self.spec)
        _check_finite(amax, self.owner)
        if self._calib_amax is None:
            self._calib_amax = amax.clone()
        elif self._calib_amax.shape != amax.shape:
            raise ShapeChangedError(
                f"{self.owner}: amax shape changed between calibration batches "
                f"({tuple(self._calib_amax.shape)} -> {tuple(amax.shape)}); a {self.spec.granularity} "
                "quantizer needs inputs of a consistent shape along its channel / block axes"
            )
        else:
            torch.maximum(self._calib_amax, amax, out=self._calib_amax)
        if self._track_amax:
            self._amaxs.append(amax.float().cpu().numpy())
        self.num_batches += 1

    def compute_amax(self) -> torch.Tensor | None:
        return None if self._calib_amax is None else self._calib_amax.clone()

    def reset(self) -> None:
        super().reset()
        self._calib_amax = None
        self._amaxs = []


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


_BIAS_KEYS = ("type", "method")


def bias_settings(bias: Mapping[Any, Any]) -> tuple[tuple[int, ...], str, str]:
    """``(axes, method, type)`` of a ``bias`` attribute such as ``{-2: None, -4: None, "type": "static"}``:
    the integer keys are the axes the bias is reduced over (values unused), ``"method"`` is ``"mean"``
    (default) or ``"max_min"``, ``"type"`` ``"static"`` (calibrated, default) or ``"dynamic"`` (per input)."""
    if not isinstance(bias, Mapping):
        raise TypeError(f"bias={bias!r} must be a mapping such as {{-2: None, -4: None, 'type': 'static'}}")
    axes = [k for k in bias if k not in _BIAS_KEYS]
    if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise ValueError(
            f"bias={dict(bias)!r}: its keys are the axes to reduce over (ints, at least one) and optionally "
            f"'type' ('static' / 'dynamic') and 'method' ('mean' / 'max_min')"
        )
    method, kind = bias.get("method", "mean"), bias.get("type", "static")
    if method not in ("mean", "max_min"):
        raise ValueError(f"bias method={method!r} (allowed: 'mean', 'max_min')")
    if kind not in ("static", "dynamic"):
        raise ValueError(f"bias type={kind!r} (allowed: 'static', 'dynamic')")
    return tuple(axes), method, kind


class BiasCalibrator:
    """The bias of an affine quantizer, reduced over ``axis`` (the axes listed; keepdim): ``"mean"``, the
    running mean of each batch's mean (every batch weighs the same), or ``"max_min"``, the midpoint of the
    running max and min. Constructed as in the reference library: ``BiasCalibrator(method, axis)``."""

    def __init__(self, method: str = "mean", axis: int | tuple[int, ...] | None = None):
        if method not in ("mean", "max_min"):
            raise ValueError(f"BiasCalibrator: method={method!r} (allowed: 'mean', 'max_min')")
        self.method = method
        self.axis = (axis,) if isinstance(axis, int) else axis
        self.reset()

    def _dims(self, x: torch.Tensor) -> tuple[int, ...] | None:
        if self.axis is None:
            return None
        return tuple(sorted({a % x.dim() for a in self.axis if -x.dim() <= a < x.dim()}))

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        dims = self._dims(x)
        if dims is None:
            return getattr(torch, op)(x)
        return getattr(torch, op)(x, dim=dims, keepdim=True)

    def compute_dynamic_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The bias of ``x`` alone (a ``"dynamic"`` bias)."""
        if self.method == "mean":
            return self._reduce(x, "mean")
        return (self._reduce(x, "amax") + self._reduce(x, "amin")) / 2

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach()
        if self.method == "mean":
            bias = self._reduce(x, "mean")
            if self._bias is not None:
                bias = ((self._bias.float() * self.num_batches + bias.float()) / (self.num_batches + 1)).to(
                    bias.dtype
                )
            self._bias = bias
        else:
            high, low = self._reduce(x, "amax"), self._reduce(x, "amin")
            self._max = high if self._max is None else torch.maximum(self._max, high)
            self._min = low if self._min is None else torch.minimum(self._min, low)
            self._bias = (self._max + self._min) / 2
        self.num_batches += 1

    def compute_bias(self) -> torch.Tensor | None:
        return None if self._bias is None else self._bias.clone()

    def reset(self) -> None:
        self._bias: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._min: torch.Tensor | None = None
        self.num_batches = 0


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


def sync_calibrators(calibrators: dict[str, Calibrator]) -> None:
    """Merge the statistics each rank collected on its share of the data, so every rank ends with those of
    all the data: the running max is reduced with max (a rank that saw nothing contributes nothing) and the
    batch counts are summed. No-op in a single process."""
    if not is_distributed():
        return
    histogram = [n for n, c in calibrators.items() if not isinstance(c, MaxCalibrator)]
    if histogram:
        raise NotImplementedError(
            f"{len(histogram)} quantizer(s) use a histogram calibrator (percentile / mse / entropy), which "
            f"is not merged across ranks (e.g. {histogram[0]}); calibrate in a single process or use max "
            "calibration"
        )
    reduced = all_reduce_max({n: c._calib_amax for n, c in calibrators.items()})
    counts = torch.tensor([c.num_batches for c in calibrators.values()], dtype=torch.int64)
    torch.distributed.all_reduce(counts)
    for (name, calibrator), count in zip(calibrators.items(), counts.tolist(), strict=True):
        calibrator._calib_amax = reduced[name]
        calibrator.num_batches = count
