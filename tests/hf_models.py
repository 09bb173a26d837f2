"""Tiny, randomly initialised decoders of transformers' own architectures, built offline from their
Config classes, and the token batches the tests feed them.

Every model: hidden 64, 2 layers, 4 query heads over 2 key/value heads (grouped-query attention) of
width 16, a vocabulary of 97 tokens, float32. Where an architecture has windows, layer 0 is windowed
(4 keys) and layer 1 full, so that both kinds run and the window bites on a dozen tokens; Llama 4's
layer 0 is chunked (chunks of 4 positions) and layer 1 full, without rope (its NoPE layers). Gemma 2's
soft-cap (1.5) is near the size of its scores, and Gemma's query_pre_attn_scalar (24) makes its scale
differ from 1/sqrt(head_dim); weights are drawn wider than the models' defaults (std 0.2), so that
attention is far from uniform and every one of these options shows in the logits.
"""
from __future__ import annotations

import functools

import torch

ARCHITECTURES = ("llama", "mistral", "qwen3", "gemma2", "gemma3", "gpt_oss", "llama4")
VOCAB = 97
PAD = 0
WINDOW = 4
CHUNK = 4  # Llama 4's chunked layer 0: attention_chunk_size, which transformers passes to no attention function

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              initializer_range=0.2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
BOTH = ["sliding_attention", "full_attention"]


def _architectures():
    import transformers as tf

    gemma = dict(sliding_window=WINDOW, layer_types=BOTH, query_pre_attn_scalar=24, final_logit_softcapping=None)
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                  dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=BOTH)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(gemma, attn_logit_softcapping=1.5)),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, gemma),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                    dict(sliding_window=WINDOW, layer_types=BOTH, num_local_experts=4, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM,
                   dict(attention_chunk_size=CHUNK, layer_types=["chunked_attention", "full_attention"],
                        no_rope_layers=[1, 0], num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                        intermediate_size_mlp=96, use_qk_norm=False, attn_temperature_tuning=False)),
    }


@functools.lru_cache(maxsize=None)
def build(arch: str, seed: int = 0):
    """The model of ``arch`` (one per process: tests share it), eval mode, eager attention, weights
    drawn from ``seed``. Tests set the attention implementation and train/eval mode they need."""
    config_cls, model_cls, extra = _architectures()[arch]
    config = config_cls(**COMMON, **extra)
    torch.manual_seed(seed)
    return model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    """(batch, seq) random token ids, none of them the padding, bos or eos token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=generator)


def padded(seq: int, left=(), right=(), seed: int = 0):
    """(ids, mask) of a batch: one full row, then a row per entry of ``left`` padded with that many
    tokens on the left, then one per entry of ``right`` padded on the right; padding is PAD, mask 0."""
    rows = 1 + len(left) + len(right)
    ids, mask = tokens(rows, seq, seed), torch.ones(rows, seq, dtype=torch.long)
    for row, n in enumerate(left, start=1):
        mask[row, :n] = 0
    for row, n in enumerate(right, start=1 + len(left)):
        mask[row, seq - n:] = 0
    return ids.masked_fill(mask == 0, PAD), mask
