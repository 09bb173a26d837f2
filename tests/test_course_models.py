"""Notebook 12's pieces: the sink-gradient lab through labs.check (its mistakes: tests/test_labs.py), the
paged cache writes where its block table says, and generation through flashlib's kernels equals
transformers' eager."""
from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs Triton (Linux) and transformers", allow_module_level=True)

from flashlib.course import models  # noqa: E402
from flashlib.decode import gather_cache  # noqa: E402


def test_the_sink_gradient_lab_goes_through_labs_check_and_passes_flashlibs_rule(capsys):
    from flashlib import labs, rules

    # the course's own rule, with its -inf rows, passes the lab's cases; handed in, it is no answer
    assert labs.core._run_checker("sink_grad", rules.sink_grad).problem is None
    refused = labs.check("sink_grad", rules.sink_grad)
    assert not refused and refused.mistake == "course_code" and refused.name == "sink_grad"
    assert capsys.readouterr().out.startswith("NOT YET: sink_grad: your function is the course's own")
    wrong = labs.core._run_checker("sink_grad", lambda s, l, d: -rules.sink_grad(s, l, d))
    assert wrong.problem.mistake == "sink_sign"
    labs.reset_hints("sink_grad")


def test_the_paged_cache_writes_each_position_where_its_block_table_points():
    cache = models.PagedKVCache(1, 2, 3, 4, 21, page_size=5, seed=1)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 21, 4, generator=g)
    cache.append(0, keys[:, :, :13], keys[:, :, :13])
    cache.advance(13)
    for t in range(13, 21):  # then one position at a time
        cache.append(0, keys[:, :, t:t + 1], keys[:, :, t:t + 1])
        cache.advance(1)
    assert cache.lengths.tolist() == [21, 21]
    torch.testing.assert_close(gather_cache(cache.k[0], cache.block_table, 21), keys, atol=0, rtol=0)


def test_generation_through_flashlib_equals_eager_and_each_mistake_is_seen():
    model = models.tiny_gpt_oss(seed=0)
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    eager = models.generate_eager(model, prompt, 4)
    tokens, cache = models.generate_paged(model, prompt, 4)
    assert torch.equal(tokens, eager)
    assert cache.lengths.tolist() == [8, 8]  # the last token generated, not fed back
    assert model.config._attn_implementation == "eager"  # put back afterwards
    # the window bites and the sinks matter (notebook 12 shows each over 12 tokens)
    wrong, _ = models.generate_paged(model, prompt, 4, mistake="sinks dropped")
    assert not torch.equal(wrong, eager)
    with pytest.raises(ValueError, match="argument 'mistake'"):
        models.generate_paged(model, prompt, 1, mistake="typo")


def test_the_attention_function_needs_its_cache():
    with pytest.raises(RuntimeError, match="inside generate_paged"):
        models.paged_attention(None, None, None, None, None)
