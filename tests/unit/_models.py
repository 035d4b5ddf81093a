"""Tiny transformers models built from configs in code (no hub access)."""

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 128


def tiny_llama(
    layers: int = 2,
    hidden: int = 64,
    attn: str = "sdpa",
    seed: int = 0,
    vocab: int = VOCAB,
    positions: int = 64,
):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=positions,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen3_moe(seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


def tiny_llama4(seed: int = 0):
    """Llama 4 text model: every layer MoE (4 transposed experts, top-1, a shared expert)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    cfg = Llama4TextConfig(
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=128,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=1,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        interleave_moe_layer_step=1,
        attn_implementation="sdpa",
    )
    return Llama4ForCausalLM(cfg).eval()


def tiny_gpt_oss(seed: int = 0):
    """GPT-OSS: transposed ``(experts, in, out)`` expert storage, biases, interleaved gate / up rows."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=64, sliding_window=16, layer_types=["full_attention"],
    )  # fmt: skip
    return GptOssForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(cfg).eval()


class _Expert(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _SequentialMoe(torch.nn.Module):
    """Top-k routing over experts that are separate modules; ``routed`` keeps the last call's experts."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList([_Expert(hidden, inter) for _ in range(experts)])
        self.top_k = top_k
        self.routed: set[int] = set()

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = self.gate(flat).softmax(-1).topk(self.top_k, dim=-1)
        self.routed = set(idx.reshape(-1).tolist())
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class _SequentialMoeBlock(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.mlp = _SequentialMoe(hidden, inter, experts, top_k)

    def forward(self, x):
        x = x + self.proj(x)
        return x + self.mlp(x)


class TinySequentialMoe(torch.nn.Module):
    """MoE layers whose experts are an ``nn.ModuleList`` of MLPs (as in remote-code MoE models), each
    expert's linear layers with quantizers of their own; a dense ``proj`` in each layer."""

    def __init__(self, layers: int = 2, hidden: int = 64, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.layers = torch.nn.ModuleList(
            [_SequentialMoeBlock(hidden, hidden // 2, experts, top_k) for _ in range(layers)]
        )

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def tiny_sequential_moe(seed: int = 0) -> TinySequentialMoe:
    torch.manual_seed(seed)
    return TinySequentialMoe().eval()


BUILDERS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gpt2": tiny_gpt2}


def batches(n: int = 2, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def word_tokenizer():
    """A word-level tokenizer of the tiny models' vocabulary: ``w0`` ... ``w124``, ``<s>`` (bos, 125),
    ``</s>`` (eos, 126), ``<pad>`` (127)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 3)} | {"<s>": VOCAB - 3, "</s>": VOCAB - 2, "<pad>": VOCAB - 1}
    raw = Tokenizer(models.WordLevel(words, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
