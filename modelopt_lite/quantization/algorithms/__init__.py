"""The calibration algorithms beyond max, each registered under the reference's name when imported:
SmoothQuant, AWQ (lite / clip / full), GPTQ, MSE, local Hessian and SVDQuant. Each imports
``quantization.calibration`` (registry, targets, search helpers) and ``quantization.config``; never
``compress``, ``auto_quantize`` or the ``mtq`` facade.
"""

from . import awq, gptq, local_hessian, mse, smoothquant, svdquant  # noqa: F401  (they register at import)
