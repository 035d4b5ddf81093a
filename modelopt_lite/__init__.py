"""modelopt_lite: quantization-aware training, distillation and post-training quantization of LLMs."""

from ._version import __version__

__all__ = ["__version__"]
