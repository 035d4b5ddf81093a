"""YAML recipes: a description and a quantization config, shipped inside the package under
``recipes/<family>/<stage>/<name>.yaml`` and loaded by name (``general/ptq/nvfp4_default-kv_fp8``) or path.

A recipe file::

    description: NVFP4 weights and activations, FP8 KV cache, max calibration
    quantize:
      algorithm: max
      quant_cfg:
      - {quantizer_name: '*', enable: false}
      - ...

Loading validates it; :meth:`Recipe.to_yaml` writes it back unchanged (same keys, values and order).

Every PTQ recipe name of Model-Optimizer 0.47 (``general/ptq/nvfp4_experts_only-kv_fp8``,
``huggingface/<model_type>/ptq/...``, ``models/<org>/<model>/ptq/...``) that maps onto this library's
features is shipped under that name with the same rules; the others (auto_quantize, speculative decoding,
layer-by-layer or LSQ calibration, ...) raise :class:`UnsupportedFeatureError` naming what to use
(:data:`~.reference_recipes.REFERENCE_ONLY_RECIPES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .reference_recipes import REFERENCE_ONLY_RECIPES
from .rules import QuantizeConfig, UnsupportedFeatureError, plain

__all__ = ["Recipe", "list_recipes", "load_recipe"]

_ROOT = "recipes"
_KEYS = ("description", "quantize")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    config: QuantizeConfig

    def to_dict(self) -> dict[str, Any]:
        return {"description": self.description, "quantize": plain(self.config.to_dict())}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=110)

    @classmethod
    def from_dict(cls, data: Any, name: str) -> Recipe:
        if not isinstance(data, dict):
            raise ValueError(f"recipe {name}: expected a mapping with keys {list(_KEYS)}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown or "quantize" not in data:
            raise ValueError(
                f"recipe {name}: keys must be {list(_KEYS)} ('quantize' required); got {sorted(data)}"
            )
        description = data.get("description", "")
        if not isinstance(description, str):
            raise ValueError(f"recipe {name}: description must be a string")
        try:
            config = QuantizeConfig.from_dict(data["quantize"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"recipe {name}: {err}") from None
        return cls(name, description, config)


def _packaged() -> dict[str, Any]:
    root = resources.files(__package__).joinpath(_ROOT)
    found: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".yaml"):
                found[prefix + child.name[: -len(".yaml")]] = child

    walk(root, "")
    return found


def list_recipes() -> list[str]:
    """Names of the recipes shipped with the package."""
    return sorted(_packaged())


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a packaged recipe by name (``.yaml`` / ``.yml`` may be given), or a recipe file by path. Unknown
    names list the available ones; a name of Model-Optimizer's that is not shipped raises
    :class:`UnsupportedFeatureError` saying why and what to use instead."""
    packaged = _packaged()
    key = str(name_or_path).removesuffix(".yaml").removesuffix(".yml")
    if key in packaged:
        text, name = packaged[key].read_text(encoding="utf-8"), key
    else:
        path = Path(name_or_path)
        if not path.is_file() and key in REFERENCE_ONLY_RECIPES:
            raise UnsupportedFeatureError(
                f"recipe {key!r} (a Model-Optimizer recipe) is not shipped with this library: "
                f"{REFERENCE_ONLY_RECIPES[key]}"
            )
        if not path.is_file():
            raise ValueError(
                f"unknown recipe {str(name_or_path)!r}: not a file, and not one of {sorted(packaged)}"
            )
        text, name = path.read_text(encoding="utf-8"), str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {name}: invalid YAML: {err}") from None
    return Recipe.from_dict(data, name)
