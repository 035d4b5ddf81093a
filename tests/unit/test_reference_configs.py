"""Config dicts written for the reference library (its docs' list form and the older dict form) give the
same enabled quantizers and attributes as our presets of the same name."""

import copy

import modelopt_lite.quantization as mtq

from ._models import batches, tiny_llama

# Copied from the reference library's documentation / preset table (release 0.47), list form.
REF_NVFP4_DEFAULT_CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {
            "quantizer_name": "*weight_quantizer",
            "cfg": {
                "num_bits": (2, 1),
                "effective_bits": 4.5,
                "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
            },
        },
        {
            "quantizer_name": "*input_quantizer",
            "cfg": {
                "num_bits": (2, 1),
                "effective_bits": 4.5,
                "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
            },
        },
        {"quantizer_name": "*block_sparse_moe.gate*", "enable": False},
        {"quantizer_name": "*lm_head*", "enable": False},
        {"quantizer_name": "*mlp.gate.*", "enable": False},
        {"quantizer_name": "*router*", "enable": False},
        {"quantizer_name": "*", "parent_class": "nn.Embedding", "enable": False},
    ],
    "algorithm": "max",
}

# The older dict form (releases before the list form); "default" written last, meaning "everything else".
REF_INT8_DEFAULT_CFG_DICT_FORM = {
    "quant_cfg": {
        "*weight_quantizer": {"num_bits": 8, "axis": 0},
        "*input_quantizer": {"num_bits": 8, "axis": None},
        "*lm_head*": {"enable": False},
        "*block_sparse_moe.gate*": {"enable": False},
        "*router*": {"enable": False},
        "default": {"enable": False},
    },
    "algorithm": "max",
}

# The docs' MY_QUANT_CFG example (list form with a parent_class rule) equals INT8_DEFAULT_CFG on a Llama.
REF_MY_QUANT_CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None}},
        {"quantizer_name": "*input_quantizer", "parent_class": "nn.LeakyReLU", "enable": False},
        {"quantizer_name": "*lm_head*", "enable": False},
    ]
}


def _layout(cfg):
    model = tiny_llama()
    mtq.quantize(model, copy.deepcopy(cfg), batches())
    return {
        name: (q.attributes, None if q.amax is None else q.amax.tolist())
        for name, q in mtq.iter_quantizers(model)
        if q.is_enabled
    }


def test_reference_list_form_equals_our_preset():
    ours = _layout(mtq.NVFP4_DEFAULT_CFG)
    assert ours
    assert _layout(REF_NVFP4_DEFAULT_CFG) == ours


def test_reference_dict_form_with_default_last_equals_our_preset():
    ours = _layout(mtq.INT8_DEFAULT_CFG)
    assert len(ours) == 2 * 14  # 7 linears x 2 layers, weight + input each
    assert _layout(REF_INT8_DEFAULT_CFG_DICT_FORM) == ours
    assert _layout(REF_MY_QUANT_CFG) == ours
