"""Floor 6, the top: the command lines, applications on top of the library. ``ptq`` (``modelopt-lite-ptq``,
``examples/llm_ptq/hf_ptq.py``: load, calibrate and quantize, evaluate, export) with what its ``--qformat``
means in ``ptq_config``, and ``default_model`` (``modelopt-lite-default-model``: build or find the default
and real models in the cache).

They may import every floor below (training, export, quantization, models, ...); no module of the library
imports them. This ``__init__`` imports nothing, so that each command loads only what it needs.
"""
