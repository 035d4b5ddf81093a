"""Floor 4: the ``mto`` namespace. ``import modelopt_lite.opt as mto``::

mto.save(model, "quantized.safetensors")          # weights + quantizer tensors + state (JSON metadata)
mto.restore(fresh_model, "quantized.safetensors") # re-create quantizers, load everything
mto.enable_huggingface_checkpointing()            # save_pretrained / from_pretrained carry the state

The reference's other names (``load_modelopt_state``, ``restore_from_modelopt_state(model, modelopt_state=...,
modelopt_state_path=...)``, ``apply_mode``, ``ModeloptStateManager``) are in :mod:`.compat`.
"""

from .checkpoint import load_state, restore, save
from .compat import ModeloptStateManager, apply_mode, load_modelopt_state, restore_from_modelopt_state
from .hf import disable_huggingface_checkpointing, enable_huggingface_checkpointing
from .state import modelopt_state

__all__ = [
    "ModeloptStateManager",
    "apply_mode",
    "disable_huggingface_checkpointing",
    "enable_huggingface_checkpointing",
    "load_modelopt_state",
    "load_state",
    "modelopt_state",
    "restore",
    "restore_from_modelopt_state",
    "save",
]
