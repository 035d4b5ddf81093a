"""The calibrator base class and max calibration: :class:`Calibrator` (``collect`` batches, then
``compute_amax``), :class:`MaxCalibrator`, which keeps the running max of ``|x|`` over the reduce axes of the
quantizer's spec (a scalar per tensor, ``keepdim`` per channel, one value per static block), and
:func:`sync_calibrators`, which merges what the ranks collected.

Non-finite input raises: a NaN or inf reaching calibration would otherwise become a NaN scale.
"""

from __future__ import annotations

from typing import Any

import torch

from ...distributed import all_reduce_max, is_distributed
from ...formats import FormatSpec, reduce_amax, resolve_format

__all__ = ["Calibrator", "MaxCalibrator", "ShapeChangedError", "sync_calibrators"]


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
