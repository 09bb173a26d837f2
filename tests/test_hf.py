"""A real pretrained model (all-MiniLM-L6-v2, through Hugging Face transformers) on flashlib's attention.

Its sentence embeddings with flashlib's attention must equal those with transformers' own
(SDPA) attention: a batch of real sentences of different lengths, so that padding is there.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib import hf  # noqa: E402

SENTENCES = [
    "FlashAttention computes exact attention tile by tile.",
    "A cat sat on the mat.",
    "The running maximum and the denominator are carried from one tile of keys to the next, and the output is "
    "rescaled whenever the maximum grows.",
    "Short.",
]


@pytest.fixture(scope="module")
def models():
    name = hf.register()
    tokenizer, reference = hf.load_model("sdpa")
    _, ours = hf.load_model(name)
    return tokenizer, reference, ours


@pytest.fixture(scope="module")
def batched(models):
    """flashlib's embeddings of SENTENCES as one padded batch (the interpreter's work, done once for the
    tests below), and the shape of the mask each call of flashlib's attention function was given.

    Registered without a mask function, an attention function gets no padding mask: a spy in front
    of flashlib's records what it receives."""
    tokenizer, _, ours = models
    seen = []
    real = hf.attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return real(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(hf.NAME, spy)
    try:
        embeddings = hf.sentence_embeddings(tokenizer, ours, SENTENCES)
    finally:
        AttentionInterface.register(hf.NAME, real)
    return embeddings, seen


def test_sentence_embeddings_equal_transformers_own_attention(models, batched):
    tokenizer, reference, _ = models
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # the batch is padded: the mask matters
    want = hf.sentence_embeddings(tokenizer, reference, SENTENCES)
    got, _ = batched
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert cosine.min().item() >= 0.9999, cosine


def test_each_sentence_alone_gives_its_batched_embedding(models, batched):
    """Padding changes nothing: a sentence embedded alone (no mask) equals its row of the batch."""
    tokenizer, _, ours = models
    for i, sentence in enumerate(SENTENCES):
        alone = hf.sentence_embeddings(tokenizer, ours, [sentence])
        torch.testing.assert_close(alone[0], batched[0][i], atol=1e-5, rtol=1e-5)


def test_the_padding_mask_reaches_flashlib(models, batched):
    """flashlib's attention function receives the (batch, seq) mask of valid tokens for a padded batch."""
    tokenizer, _, _ = models
    _, seen = batched
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()
    assert seen and all(shape == tuple(batch["attention_mask"].shape) for shape in seen)


def test_a_name_with_flash_is_refused():
    with pytest.raises(ValueError, match="'name'.*hub"):
        hf.register("flashlib")


def test_a_heads_inputs_give_that_heads_output(models):
    """The q, k, v captured for one head reproduce that head's slice of the layer's attention output."""
    tokenizer, reference, _ = models
    sentence, layer, head = "FlashAttention is exact.", 1, 5
    q, k, v, tokens = hf.head_inputs(tokenizer, reference, sentence, layer=layer, head=head)
    out = {}
    self_attention = reference.encoder.layer[layer].attention.self
    hook = self_attention.register_forward_hook(lambda m, i, o: out.__setitem__("o", o[0].detach()))
    try:
        with torch.no_grad():
            reference(**tokenizer([sentence], return_tensors="pt"))
    finally:
        hook.remove()
    width = q.shape[-1]
    from flashlib import dense_attention

    torch.testing.assert_close(dense_attention(q, k, v), out["o"][0, :, head * width:(head + 1) * width],
                               atol=1e-5, rtol=1e-5)
    assert len(tokens) == q.shape[0] and tokens[0] == "[CLS]"


def test_missing_names_what_is_not_installed(monkeypatch):
    assert hf.missing() is None  # the test environment installs both
    real = importlib.util.find_spec
    for absent, named in (("transformers", "transformers is not installed"), (hf.MODEL_PACKAGE, "model package")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, absent=absent: None if name == absent
                            else real(name))
        assert named in hf.missing()
        monkeypatch.undo()
