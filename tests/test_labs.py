"""flashlib.labs: every worked solution passes, every known mistake is named, the notebooks run their labs.

Mistaken code is written as small edits of the worked solutions (each edit must find its text,
so a changed solution fails here loudly rather than testing nothing).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest
import torch

from flashlib import labs
from flashlib.labs import cells

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton ships Linux wheels only")
LAB_NAMES = [pytest.param(name, marks=needs_triton if spec.triton else ()) for name, spec in labs.LABS.items()]
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHECKER_SECONDS = 20


def load(source: str, name: str, tmp_path: Path):
    """The function ``name`` defined by ``source``, imported from a file (Triton reads a kernel's source)."""
    path = tmp_path / f"lab_{name}_{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def edited(name: str, tmp_path: Path, *edits):
    source = labs.solution_source(name)
    for old, new in edits:
        assert old in source, f"the solution of {name} no longer contains {old!r}"
        source = source.replace(old, new)
    return load(source, name, tmp_path)


def counted(fn):
    """fn, counting its calls: a PyTorch lab's checker calls the learner's function once per case."""
    def wrapper(*args):
        wrapper.calls += 1
        return fn(*args)
    wrapper.calls = 0
    return wrapper


@pytest.mark.parametrize("name", LAB_NAMES)
def test_every_worked_solution_passes_its_checker_in_time(name, tmp_path, capsys):
    solution = load(labs.solution_source(name), name, tmp_path)
    if not labs.LABS[name].triton:
        solution = counted(solution)
    start = time.perf_counter()
    result = labs.check(name, solution)
    seconds = time.perf_counter() - start
    printed = capsys.readouterr().out
    assert result and result.passed and result.mistake is None, result.message
    assert printed.strip() == result.message and result.message.startswith("PASS")
    assert seconds < CHECKER_SECONDS
    if labs.LABS[name].triton:
        from flashlib.labs.kernel_labs import CASES
        cases = len(CASES)
    else:
        cases = solution.calls
    tries = ", ".join(labs.LABS[name].tries)
    assert result.message == f"PASS: {name} is right in all {cases} cases, which between them try {tries}."


@needs_triton
def test_the_teaching_kernels_loops_pass_the_kernel_labs(capsys, monkeypatch):
    """The harness calls the learner's loop exactly as the teaching kernels call theirs (run past the
    refusal of the course's own code, which labs.check gives them as answers). The course's
    dK/dV loop reads the lse in base 2, as the course's forward stores it (notebook 06); the lab hands a
    learner the natural lse, as flashlib's callers see it. Given the base-2 one, the course's loop passes."""
    from flashlib.kernels import backward, forward
    from flashlib.kernels.config import LOG2E
    from flashlib.labs import kernel_labs

    assert labs.core._run_checker("attn_fwd_inner", forward._attn_fwd_inner).problem is None
    natural = kernel_labs.expected_backward

    def base2(case, *args):
        out, lse, grads = natural(case, *args)
        return out, lse * LOG2E, grads

    monkeypatch.setattr(kernel_labs, "expected_backward", base2)
    assert labs.core._run_checker("attn_bwd_dkdv_inner", backward._attn_bwd_dkdv_inner).problem is None


ONLINE = [
    ("no_rescale", [("l = l * torch.exp(m - shift) + ", "l = l + ")]),
    ("max_starts_at_zero", [('torch.tensor(float("-inf"))', "torch.tensor(0.0)")]),
    ("nan_empty_rows", [('shift = torch.where(m_new == float("-inf"), 0.0, m_new)', "shift = m_new")]),
    ("swapped_outputs", [("    return m, l", "    return l, m")]),
    ("exp2_for_exp", [("torch.exp(m - shift)", "torch.exp2(m - shift)"),
                      ("torch.exp(block - shift[:, None])", "torch.exp2(block - shift[:, None])")]),
]
MERGE = [
    ("no_rescale", [("l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b")]),
    ("inverted_rescale", [("torch.exp(m_a - shift)", "torch.exp(shift - m_a)"),
                          ("torch.exp(m_b - shift)", "torch.exp(shift - m_b)")]),
    ("nan_empty_rows", [('shift = torch.where(m == float("-inf"), 0.0, m)', "shift = m")]),
    ("overflow", [("l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)",
                   "(l_a * torch.exp(m_a) + l_b * torch.exp(m_b)) * torch.exp(-m)")]),
    ("swapped_outputs", [("return m, l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)",
                          "return l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift), m")]),
    ("exp2_for_exp", [("torch.exp(m_a - shift)", "torch.exp2(m_a - shift)"),
                      ("torch.exp(m_b - shift)", "torch.exp2(m_b - shift)")]),
]
FORWARD = [
    ("no_rescale", [("l_i = alpha * l_i + ", "l_i = l_i + ")]),
    ("no_rescale", [("acc = alpha[..., None] * acc + ", "acc = acc + ")]),
    ("max_starts_at_zero", [('m_i = q.new_full(q_blk.shape[:-1], float("-inf"))',
                             "m_i = q.new_zeros(q_blk.shape[:-1])")]),
    ("nan_empty_rows", [('shift = torch.where(m_new == float("-inf"), 0.0, m_new)', "shift = m_new")]),
    ("top_left_causal", [("offs_k > offs_q + seq_k - seq_q", "offs_k > offs_q"),
                         ("k_end = min(q1 + seq_k - seq_q, seq_k) if causal else seq_k", "k_end = seq_k")]),
    ("dropped_last_tile", [("range(0, k_end, block_k)", "range(0, k_end // block_k * block_k, block_k)")]),
    ("dropped_last_tile", [("range(0, seq_q, block_q)", "range(0, seq_q // block_q * block_q, block_q)")]),
    ("full_matrix", [("s = q_blk @ k[..., k0:k1, :].transpose(-2, -1) * scale",
                      "s = (q @ k.transpose(-2, -1) * scale)[..., q0:q1, k0:k1]")]),
    ("unscaled_scores", [("scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])",
                          "scale = q.shape[-2], k.shape[-2], 1.0")]),
    ("unscaled_scores", [("scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])",
                          "scale = q.shape[-2], k.shape[-2], math.sqrt(q.shape[-1])")]),
    ("exp2_for_exp", [("alpha = torch.exp(m_i - shift)", "alpha = torch.exp2(m_i - shift)"),
                      ("p = torch.exp(s - shift[..., None])", "p = torch.exp2(s - shift[..., None])")]),
    ("strict_diagonal", [("offs_k > offs_q + seq_k - seq_q", "offs_k >= offs_q + seq_k - seq_q")]),
    ("inverted_rescale", [("alpha = torch.exp(m_i - shift)", "alpha = torch.exp(shift - m_i)")]),
    ("inverted_rescale", [("alpha = torch.exp(m_i - shift)",
                           'alpha = torch.where(m_i == float("-inf"), 0.0, torch.exp(shift - m_i))')]),
    ("lse_base2", [("m_i + torch.log(l_i)", "m_i + torch.log2(l_i)")]),
    ("lse_without_max", [("m_i + torch.log(l_i)", "torch.log(l_i)")]),
    ("not_normalised", [("out[..., q0:q1, :] = acc / torch.where(seen, l_i, 1.0)[..., None]",
                         "out[..., q0:q1, :] = acc")]),
    ("causal_mask_missing", [('s = s.masked_fill(offs_k > offs_q + seq_k - seq_q, float("-inf"))', "s = s")]),
    ("causal_mask_missing", [('s = s.masked_fill(offs_k > offs_q + seq_k - seq_q, float("-inf"))', "s = s"),
                             ("k_end = min(q1 + seq_k - seq_q, seq_k) if causal else seq_k", "k_end = seq_k")]),
    ("last_tile_only", [("            m_new = torch.maximum(m_i, s.amax(dim=-1))",
                         '            m_i = q.new_full(q_blk.shape[:-1], float("-inf"))\n'
                         "            l_i = torch.zeros_like(m_i)\n"
                         "            acc = torch.zeros_like(q_blk)\n"
                         "            m_new = torch.maximum(m_i, s.amax(dim=-1))")]),
]
BACKWARD = [
    ("no_delta", [("ds = p * (dp - delta[..., q0:q1, None])", "ds = p * dp")]),
    ("unscaled_gradient", [("dq[..., q0:q1, :] += ds @ k_tile * scale", "dq[..., q0:q1, :] += ds @ k_tile")]),
    ("unscaled_gradient", [("dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale",
                            "dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk")]),
    ("nan_empty_rows", [('lse = torch.where(lse == float("-inf"), float("inf"), lse)', "pass")]),
    ("top_left_causal", [("offs_k > offs_q + seq_k - seq_q", "offs_k > offs_q")]),
    ("dropped_last_tile", [("range(0, seq_k, block_k)", "range(0, seq_k // block_k * block_k, block_k)")]),
    ("dropped_last_tile", [("range(0, seq_q, block_q)", "range(0, seq_q // block_q * block_q, block_q)")]),
    ("full_matrix", [("p = torch.exp(s - lse[..., q0:q1, None])",
                      "p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])[..., q0:q1, k0:k1]")]),
    ("tile_delta", [("ds = p * (dp - delta[..., q0:q1, None])", "ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))")]),
    ("swapped_outputs", [("return dq, dk, dv", "return dq, dv, dk")]),
    ("scaled_twice", [("dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale",
                       "dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale * scale")]),
    ("causal_mask_missing", [('s = s.masked_fill(offs_k > offs_q + seq_k - seq_q, float("-inf"))', "s = s")]),
    ("strict_diagonal", [("offs_k > offs_q + seq_k - seq_q", "offs_k >= offs_q + seq_k - seq_q")]),
    ("exp2_for_exp", [("p = torch.exp(s - lse[..., q0:q1, None])", "p = torch.exp2(s - lse[..., q0:q1, None])")]),
]
KERNEL_FORWARD = [
    ("masked_loads_missing", [("mask=kv_mask, other=0.0)\n        v_tile", ")\n        v_tile")]),
    ("masked_loads_missing", [("kv_mask = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)",
                               "kv_mask = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < 32)")]),
    ("store_outside", [("        v_tile = tl.load(",
                        "        tl.store(K + offs_k[:, None] * stride_kn + offs_d[None, :], k_tile)\n"
                        "        v_tile = tl.load(")]),
    ("nothing_done", [("range(0, k_end, BLOCK_K)", "range(0, 0, BLOCK_K)")]),
    ("inverted_rescale", [("alpha = tl.math.exp2(m_i - shift)", "alpha = tl.math.exp2(shift - m_i)")]),
    ("inverted_rescale", [("alpha = tl.math.exp2(m_i - shift)",
                           'alpha = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2(shift - m_i))')]),
    ("no_rescale", [("l_i = alpha * l_i + ", "l_i = l_i + ")]),
    ("no_rescale", [("acc = alpha[:, None] * acc + ", "acc = acc + ")]),
    ("nan_empty_rows", [('shift = tl.where(m_new == float("-inf"), 0.0, m_new)', "shift = m_new")]),
    ("top_left_causal", [("offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q)",
                          "offs_k[None, :] <= offs_q[:, None]")]),
    ("causal_mask_missing", [("visible = visible & (offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q))",
                              "visible = visible")]),
    ("dropped_last_tile", [("range(0, k_end, BLOCK_K)", "range(0, k_end // BLOCK_K * BLOCK_K, BLOCK_K)")]),
    ("natural_exp_base2", [("tl.math.exp2(m_i - shift)", "tl.exp(m_i - shift)"),
                           ("tl.math.exp2(s - shift[:, None])", "tl.exp(s - shift[:, None])")]),
    ("natural_exp_base2", [("tl.math.exp2(m_i - shift)", "tl.exp(m_i - shift)")]),
    ("strict_diagonal", [("offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q)",
                          "offs_k[None, :] < offs_q[:, None] + (SEQ_K - SEQ_Q)")]),
    ("padded_keys", [("visible = (offs_q[:, None] < SEQ_Q) & (offs_k[None, :] < SEQ_K)",
                      "visible = offs_q[:, None] < SEQ_Q")]),
    ("dot_shapes", [("tl.dot(q_blk, tl.trans(k_tile)", "tl.dot(q_blk, k_tile")]),
    ("missing_cast", [("tl.dot(p.to(v_tile.dtype), v_tile", "tl.dot(p, v_tile")]),
    ("no_input_precision", [("tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION)",
                             "tl.dot(q_blk, tl.trans(k_tile))")]),
    ("last_tile_only", [("        m_i = m_new\n", "")]),
    ("unscaled_scores", [(") * qk_scale", ")")]),
    ("bare_inf", [('tl.where(m_new == float("-inf"), 0.0, m_new)', "tl.where(m_new == -inf, 0.0, m_new)")]),
]
KERNEL_DKDV = [
    ("masked_loads_missing", [("q_blk = tl.load(Q + offs_q[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, "
                               "other=0.0)", "q_blk = tl.load(Q + offs_q[:, None] * stride_qm + offs_d[None, :])")]),
    ("masked_loads_missing", [('lse = tl.load(Lse + offs_q, mask=in_rows, other=float("inf"))',
                               "lse = tl.load(Lse + offs_q)")]),
    ("masked_loads_missing", [("delta = tl.load(Delta + offs_q, mask=in_rows, other=0.0)",
                               "delta = tl.load(Delta + offs_q)")]),
    ("store_outside", [("        delta = tl.load(",
                        "        tl.store(Delta + offs_q, lse)\n        delta = tl.load(")]),
    ("nothing_done", [("range(q_start, SEQ_Q, BLOCK_Q)", "range(q_start, q_start, BLOCK_Q)")]),
    ("no_delta", [("ds_t = p_t * (dp_t - delta[None, :])", "ds_t = p_t * dp_t")]),
    ("natural_exp_base2", [("lse * LOG2E)", "lse)")]),
    ("natural_exp_base2", [("p_t = tl.math.exp2(s_t - lse[None, :])", "p_t = tl.exp(s_t - lse[None, :])")]),
    ("top_left_causal", [("offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q)",
                          "offs_k[:, None] <= offs_q[None, :]")]),
    ("causal_mask_missing", [("visible = visible & (offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q))",
                              "visible = visible")]),
    ("dropped_last_tile", [("range(q_start, SEQ_Q, BLOCK_Q)", "range(q_start, SEQ_Q // BLOCK_Q * BLOCK_Q, BLOCK_Q)")]),
    ("scaled_twice", [("dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)",
                       "dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION) * qk_scale")]),
    ("scaled_twice", [("dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)",
                       "dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION) * "
                       "(qk_scale / LOG2E)")]),
    ("tile_delta", [("ds_t = p_t * (dp_t - delta[None, :])", "ds_t = p_t * (dp_t - tl.sum(p_t * dp_t, 0)[None, :])")]),
    ("swapped_outputs", [("return dk, dv", "return dv, dk")]),
    ("strict_diagonal", [("offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q)",
                          "offs_k[:, None] < offs_q[None, :] + (SEQ_K - SEQ_Q)")]),
    ("dot_shapes", [("tl.dot(k_tile, tl.trans(q_blk)", "tl.dot(k_tile, q_blk")]),
    ("missing_cast", [("tl.dot(p_t.to(do_blk.dtype), do_blk", "tl.dot(p_t, do_blk")]),
    ("no_input_precision", [("dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)",
                             "dp_t = tl.dot(v_tile, tl.trans(do_blk))")]),
]
KERNEL_FORWARD += [
    ("wrong_stride", [("V + offs_k[:, None] * stride_vn", "V + offs_k[:, None] * stride_kn")]),
    ("causal_tiles_not_skipped", [("range(0, k_end, BLOCK_K)", "range(0, SEQ_K, BLOCK_K)")]),
]
KERNEL_DKDV += [
    ("wrong_stride", [("DO + offs_q[:, None] * stride_dom", "DO + offs_q[:, None] * stride_qm")]),
    ("causal_tiles_not_skipped", [("range(q_start, SEQ_Q, BLOCK_Q)", "range(0, SEQ_Q, BLOCK_Q)")]),
    ("transposed_broadcast", [("p_t = tl.math.exp2(s_t - lse[None, :])", "p_t = tl.math.exp2(s_t - lse[:, None])")]),
    ("transposed_broadcast", [("ds_t = p_t * (dp_t - delta[None, :])", "ds_t = p_t * (dp_t - delta[:, None])")]),
]
SPLIT_KV = [
    ("averaged_partials", [("(shares[:, None] * torch.stack(outs)).sum(dim=0)", "torch.stack(outs).mean(dim=0)")]),
    ("summed_partials", [("(shares[:, None] * torch.stack(outs)).sum(dim=0)", "torch.stack(outs).sum(dim=0)")]),
    ("unnormalised_weights", [("torch.exp(lses - torch.logsumexp(lses, dim=0))", "torch.exp(lses)")]),
    ("last_split_only", [("(shares[:, None] * torch.stack(outs)).sum(dim=0)", "outs[-1]")]),
    ("overflow", [("torch.exp(lses - torch.logsumexp(lses, dim=0))", "torch.exp(lses) / torch.exp(lses).sum()")]),
    ("unscaled_scores", [(" / math.sqrt(q.shape[0])", "")]),
    ("dropped_last_tile", [("range(0, k.shape[0], size)", "range(0, k.shape[0] - 1, size)"),
                           ("v[start:start + size]", "v[start:min(start + size, k.shape[0] - 1)]"),
                           ("s = k[start:start + size]", "s = k[start:min(start + size, k.shape[0] - 1)]")]),
    ("exp2_for_exp", [(" / math.sqrt(q.shape[0])", " / math.sqrt(q.shape[0]) * math.log(2)")]),
    ("no_split", [("size = -(-k.shape[0] // num_splits)", "size = k.shape[0]")]),  # one split, whatever num_splits
]
SINK_GRAD = [
    ("sink_sign", [("return -(p_sink * delta)", "return (p_sink * delta)")]),
    ("no_delta", [("return -(p_sink * delta)", "return -(p_sink)")]),
    ("sink_not_normalised", [("torch.exp(sinks[:, None] - lse)", "torch.exp(sinks[:, None]) + 0 * lse")]),
    ("exp2_for_exp", [("torch.exp(sinks[:, None] - lse)", "torch.exp2(sinks[:, None] - lse)")]),
    ("flipped_exponent", [("torch.exp(sinks[:, None] - lse)", "torch.exp(lse - sinks[:, None])")]),
    ("sum_axes", [(".sum(dim=(0, 2))", "[0].sum(dim=-1)")]),
    ("sum_axes", [(".sum(dim=(0, 2))", ".mean(dim=(0, 2))")]),
    ("sum_axes", [(".sum(dim=(0, 2))", ".mean(dim=2).sum(dim=0)")]),  # a factor of the row count
    ("nan_empty_rows", [('p_sink = torch.where(lse == float("-inf"), 0.0, p_sink)', "pass")]),
]
MISTAKEN = [pytest.param(lab, mistake, edits, marks=needs_triton if labs.LABS[lab].triton else (),
                         id=f"{lab}-{mistake}-{i}")
            for i, (lab, mistake, edits) in enumerate((lab, mistake, edits) for lab, table in (
    ("online_softmax", ONLINE), ("merge_states", MERGE), ("tiled_forward", FORWARD), ("tiled_backward", BACKWARD),
    ("attn_fwd_inner", KERNEL_FORWARD), ("attn_bwd_dkdv_inner", KERNEL_DKDV), ("split_kv", SPLIT_KV),
    ("sink_grad", SINK_GRAD)) for mistake, edits in table)]


@pytest.mark.parametrize("name, mistake, edits", MISTAKEN)
def test_a_known_mistake_is_named(name, mistake, edits, tmp_path, capsys):
    result = labs.check(name, edited(name, tmp_path, *edits))
    assert not result and result.mistake == mistake, result.message
    title = labs.MISTAKES[mistake][0]
    assert f"mistake: {title}" in capsys.readouterr().out
    assert result.message.startswith(f"NOT YET: {name}, case {result.case} of ")


# Mistakes no catalogue entry names: the message says what is right, what is not, and where.
GENERIC = [
    ("tiled_forward", [("m_i + torch.log(l_i)", "(m_i + torch.log(l_i)) * 1.4426950408889634")],
     ["out is right; lse is wrong", "lse is 1.443 times what it should be everywhere: a factor of log2 e"]),
    ("tiled_forward", [("offs_k > offs_q + seq_k - seq_q", "offs_k > offs_q + seq_k - seq_q + 1")],
     ["case 3 of 6", "query 0 gives key 9 weight 0.0533, but it must not see key 9 (query 0 sees keys 0–8)",
      "every pair that differs has key j = i + 9, +1 from the diagonal j = i + 8"]),
    ("tiled_backward", [("dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale",
                         "dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale * 2")],
     ["dq and dv are right; dk is wrong", "dk is 2 times what it should be everywhere"]),
    ("tiled_backward", [("dq[..., q0:q1, :] += ds @ k_tile * scale", "dq[..., q0:q1, :] += ds @ k_tile * scale\n"
                         "            if k1 == seq_k:\n                dq[..., q0:q1, :] += ds @ k_tile * scale")],
     ["dk and dv are right; dq is wrong"]),
    ("attn_fwd_inner", [("(offs_k[None, :] < SEQ_K)", "(offs_k[None, :] < SEQ_K - 1)")],
     ["query 0 gives key 44 no weight, but it sees key 44",
      "every pair that differs is in the last key tile (keys 32–44)"]),
    ("attn_fwd_inner", [("offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q)",
                         "offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q) + 1")],
     ["The wrong rows are exactly the rows that see only some of the keys",
      "every pair that differs has key j = i + 9, +1 from the diagonal j = i + 8"]),
    ("attn_bwd_dkdv_inner", [("ds_t = p_t * (dp_t - delta[None, :])", "ds_t = p_t * (dp_t + delta[None, :])")],
     ["dv is right; dk is wrong"]),
    ("attn_bwd_dkdv_inner", [("dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)",
                              "dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION) * 0.5")],
     ["dk is right; dv is wrong", "dv is 0.5 times what it should be everywhere: a factor of 1/2"]),
    ("attn_bwd_dkdv_inner", [("p_t = tl.where(visible, p_t, 0.0)",
                              "p_t = tl.where(visible & (offs_k[:, None] < SEQ_K - 5), p_t, 0.0)")],
     ["In dk, the wrong keys are all among the keys of the last, shorter key tile (keys 32–44)"]),
]


GENERIC += [
    ("tiled_backward", [("offs_k > offs_q + seq_k - seq_q", "offs_k > offs_q + seq_k - seq_q + 1")],
     ["query 0 gives key 9 weight 0.1, but it must not see key 9 (query 0 sees keys 0–8)"]),
    ("tiled_backward", [("dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale",
                         "dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale * (1 + (k0 == 0))")],
     ["dk is 2 times what it should be in every wrong row", "In dk, the wrong keys are 0–7",
      "the dS of query 0 and key 0 is 0.0437 where it should be 0.0219"]),
    ("attn_bwd_dkdv_inner", [("p_t = tl.math.exp2(s_t - lse[None, :])",
                              "p_t = tl.math.exp2(s_t - lse[None, :]) * 1.5")],
     ["dv is 1.5 times what it should be everywhere",
      "With q and dO the identity, dv holds Pᵀ and dk / scale holds dSᵀ: query 0 gives key 0 weight"]),
    ("attn_bwd_dkdv_inner", [("offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q)",
                              "offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q) + 1")],
     ["but it must not see key 9 (query 0 sees keys 0–8)",
      "every pair that differs has key j = i + 9, +1 from the diagonal j = i + 8"]),
    ("split_kv", [("(shares[:, None] * torch.stack(outs)).sum(dim=0)",
                   "(shares[:, None] * torch.stack(outs)).sum(dim=0) * 2")],
     ["case 1 of 5", "Your output is 2 times the right one"]),
    ("sink_grad", [("return -(p_sink * delta)", "return -3 * (p_sink * delta)")],
     ["your gradient is 3 times autograd's for every head."]),
]


@pytest.mark.parametrize("name, edits, said", [pytest.param(*g, marks=needs_triton if labs.LABS[g[0]].triton else (),
                                                            id=f"{g[0]}-{i}") for i, g in enumerate(GENERIC)])
def test_an_unknown_mistake_is_described(name, edits, said, tmp_path, capsys):
    result = labs.check(name, edited(name, tmp_path, *edits))
    assert not result and result.mistake is None, result.message
    for text in said:
        assert text in result.message


STREAMING = {"online_softmax": {"read_after_next", "read_twice", "full_matrix"}}


def test_every_mistake_a_lab_claims_to_name_is_tested():
    tested = {}
    for param in MISTAKEN:
        tested.setdefault(param.values[0], set()).add(param.values[1])
    for name, keys in STREAMING.items():
        tested[name] |= keys
    assert {name: set(spec.mistakes) for name, spec in labs.LABS.items()} == tested


def kept_blocks(blocks):
    blocks = list(blocks)  # every block kept: read again after the next one came
    m = torch.stack([b.amax(dim=-1) for b in blocks]).amax(dim=0)
    return m, sum(torch.exp(b - m[:, None]).sum(dim=-1) for b in blocks)


def two_passes(blocks):
    m = torch.tensor(float("-inf"))
    for b in blocks:
        m = torch.maximum(m, b.amax(dim=-1))
    l = torch.zeros_like(m)
    for b in blocks:  # finds nothing: the iterator is spent
        l = l + torch.exp(b - m[:, None]).sum(dim=-1)
    return m, l


def whole_row(blocks):
    x = torch.cat(list(blocks), dim=-1)  # (rows, width): the whole row at once
    m = x.amax(dim=-1)
    return m, torch.exp(x - m[:, None]).sum(dim=-1)


@pytest.mark.parametrize("fn, mistake", [(kept_blocks, "read_after_next"), (two_passes, "read_twice"),
                                         (whole_row, "full_matrix")])
def test_online_softmax_must_stream(fn, mistake, capsys):
    result = labs.check("online_softmax", fn)
    assert not result and result.mistake == mistake, result.message


def plain_attention(q, k, v, num_splits):
    """Handed in as split_kv: attention over all the keys at once, num_splits ignored. Its output is right."""
    return torch.softmax(k @ q / math.sqrt(q.shape[0]), dim=0) @ v


def scores_then_splits(q, k, v, num_splits):
    """Handed in as split_kv: every score at once, then the splits' softmax and lse cut from them, merged."""
    s = k @ q / math.sqrt(q.shape[0])  # (L,): one product over every key
    size = -(-k.shape[0] // num_splits)
    lses = torch.stack([torch.logsumexp(s[a:a + size], 0) for a in range(0, k.shape[0], size)])
    outs = torch.stack([torch.softmax(s[a:a + size], 0) @ v[a:a + size] for a in range(0, k.shape[0], size)])
    return (torch.exp(lses - torch.logsumexp(lses, 0))[:, None] * outs).sum(0)


def sdpa_over_all_keys(q, k, v, num_splits):
    """Handed in as split_kv: PyTorch's fused attention over the whole cache."""
    return torch.nn.functional.scaled_dot_product_attention(q[None, None, None], k[None, None], v[None, None])[0, 0, 0]


def elementwise_scores(q, k, v, num_splits):
    """Handed in as split_kv: plain attention written without a matrix product."""
    p = torch.softmax((k * q).sum(-1) / math.sqrt(q.shape[0]), dim=0)
    return (p[:, None] * v).sum(0)


@pytest.mark.parametrize("fn", [plain_attention, scores_then_splits, elementwise_scores])
def test_split_kv_refuses_keys_that_were_never_split(fn, capsys):
    """Each gives attention's right output; none computes a split from its own keys alone."""
    q, k, v = (torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
               for shape in ((8,), (7, 8), (7, 8)))
    want = torch.softmax(k @ q / math.sqrt(8), dim=0) @ v
    assert torch.allclose(fn(q, k, v, 3), want, rtol=0, atol=1e-12)
    result = labs.check("split_kv", fn)
    assert not result and result.mistake == "no_split", result.message
    assert result.message.startswith("NOT YET: split_kv, case 2 of 5 (7 keys, num_splits=3): an operation (")
    assert "the 7 keys come in splits of at most 3" in result.message
    assert f"mistake: {labs.MISTAKES['no_split'][0]}" in capsys.readouterr().out


def test_split_kv_names_sdpa_over_the_whole_cache_first():
    """The fused call is the more precise name for the same non-answer: the library did the work."""
    result = labs.check("split_kv", sdpa_over_all_keys)
    assert not result and result.mistake == "library_attention", result.message


@needs_triton
def test_a_stray_load_is_named_by_tensor_and_side(tmp_path, capsys):
    past_rows = edited("attn_fwd_inner", tmp_path,
                       ("kv_mask = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)",
                        "kv_mask = offs_d[None, :] < HEAD_DIM"))
    assert "a tl.load read K past its last row (row 45 >= 45)" in labs.check("attn_fwd_inner", past_rows).message
    past_columns = edited("attn_fwd_inner", tmp_path, ("(offs_d[None, :] < HEAD_DIM)", "(offs_d[None, :] < 32)"))
    message = labs.check("attn_fwd_inner", past_columns).message
    assert "HEAD_DIM=24" in message and "past its last column (column 24 >= HEAD_DIM = 24)" in message
    above = edited("attn_bwd_dkdv_inner", tmp_path, ("delta = tl.load(Delta + offs_q, mask=in_rows, other=0.0)",
                                                     "delta = tl.load(Delta + offs_q - 1, mask=in_rows, other=0.0)"))
    assert "a tl.load read Delta above its first row (row -1)" in labs.check("attn_bwd_dkdv_inner", above).message


COMPILE = """
from flashlib.kernels.compile import CompileReport, compile_and_inspect
from flashlib.kernels.config import head_dim_pad
from flashlib.labs import harness
from flashlib.labs.kernel_labs import CASES
from flashlib.labs.solutions.attn_bwd_dkdv_inner import attn_bwd_dkdv_inner
from flashlib.labs.solutions.attn_fwd_inner import attn_fwd_inner

# a covering design: each case compiled once per kernel, the two targets alternating between the kernels,
# so that every case meets both targets and each kernel both (the float16 case: forward for 7.5, backward for 9.0)
CAPABILITIES = ((7, 5), (9, 0))
for i, case in enumerate(CASES):
    dtype = str(case.dtype).removeprefix("torch.")  # float16 tiles: tl.dot's operands must match
    for turn, (kernel, inner, float32) in enumerate(((harness.lab_attn_fwd, attn_fwd_inner, ("Lse",)),
                                                     (harness.lab_attn_bwd_dkdv, attn_bwd_dkdv_inner,
                                                      ("Lse", "Delta")))):
        capability = CAPABILITIES[(i + turn) % 2]
        report = CompileReport(kernel=kernel.__name__, capability=capability, dtype=dtype,
                               head_dim=case.head_dim, causal=case.causal, config={}, triton_version="")
        constants = dict(HEAD_DIM_PAD=head_dim_pad(case.head_dim), BLOCK_Q=case.block_q, BLOCK_K=case.block_k,
                         CAUSAL=case.causal, INPUT_PRECISION="ieee", INNER=inner)
        compile_and_inspect(report, kernel, dtype, constants, {}, capability, float32=float32)
"""


@needs_triton
def test_the_kernel_labs_compile_for_gpus_as_a_gpu_runtime_would_launch_them():
    """On a GPU the checker compiles the harness with the learner's loop: the solutions, for a T4 and an H100."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_guard_shows_a_store_outside_its_tensor():
    from flashlib.labs.memory import guarded

    out = guarded("Out", torch.zeros(2, 5, 3), guard_rows=4, pad=2)
    assert out.guards_intact(float("nan")) and out.view.shape == (2, 5, 3) and (out.view == 0).all()
    out.buffer[1, 4 + 5, 0] = 1.0  # the row just past the last
    assert not out.guards_intact(float("nan"))


def fused(q, k, v, block_q, block_k, causal):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out, out.sum(dim=-1)


def flexed(q, k, v, block_q, block_k, causal):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, return_lse=True)


@pytest.mark.parametrize("fn, called", [(fused, "scaled_dot_product_attention"), (flexed, "flex_attention")])
def test_pytorchs_fused_attention_is_not_a_tiled_forward(fn, called, capsys):
    result = labs.check("tiled_forward", fn)
    assert result.mistake == "library_attention" and f"called torch's {called}" in result.message


def test_flex_attention_still_works_after_a_learner_called_it_under_a_check(capsys):
    """The check runs the learner's function under a dispatch mode; flex_attention compiles itself, and a compile
    under such a mode used to break every later flex_attention of the process (a notebook's, a test's)."""
    from torch.nn.attention.flex_attention import flex_attention

    labs.check("tiled_forward", flexed)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
        out = flex_attention(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def raises(*args):
    raise RuntimeError("not finished")


@pytest.mark.parametrize("name", LAB_NAMES)
@pytest.mark.parametrize("answer", [42, "text", raises, lambda *a: (None, None), lambda *a: torch.zeros(3)])
def test_anything_wrong_gives_feedback_not_an_exception(name, answer, capsys):
    result = labs.check(name, answer)
    assert not result and result.message.startswith("NOT YET") and capsys.readouterr().out.startswith("NOT YET")


def test_feedback_says_what_a_raising_function_raised(capsys):
    assert "raised RuntimeError: not finished" in labs.check("tiled_forward", raises).message


@needs_triton
def test_a_kernel_lab_asks_for_a_triton_function(capsys):
    assert "expected a @triton.jit function; got function" in labs.check("attn_fwd_inner", raises).message


@pytest.mark.parametrize("name", LAB_NAMES)
def test_the_stub_cell_stores_no_answer_yet_and_the_solved_cell_passes(name):
    stub = cells.code_cell(name)
    assert cells.marked(stub) == name and stub.rstrip().endswith(f'passed = labs.check("{name}", {name})')
    assert cells.run_cell(stub, name).startswith("NOT YET: no answer yet; expected a function")
    assert cells.run_cell(cells.code_cell(name, solved=True), name).startswith(f"PASS: {name}")
    assert cells.marked(cells.markdown_cell(name)) == name


def test_hints_come_one_level_at_a_time_per_lab(capsys):
    labs.reset_hints()
    for level in (1, 2, 3):
        labs.hint("tiled_forward")
        assert capsys.readouterr().out.startswith(f"hint {level} of 3 for tiled_forward: ")
    labs.hint("tiled_forward")
    assert capsys.readouterr().out.startswith("No more hints for tiled_forward")
    labs.hint("merge_states")
    assert capsys.readouterr().out.startswith("hint 1 of 3 for merge_states")
    labs.reset_hints("tiled_forward")
    labs.hint("tiled_forward")
    assert capsys.readouterr().out.startswith("hint 1 of 3 for tiled_forward")
    labs.reset_hints()


@pytest.mark.parametrize("name", list(labs.LABS))
def test_hints_step_from_words_to_code(name):
    idea, pointer, code = labs.LABS[name].hints
    for token in ("=", "torch.", "tl.", "@", "range("):
        assert token not in idea, f"hint 1 of {name} is already code: {token!r}"
    assert "=" in code and len(code) > len(idea)
    for hint in (idea, pointer, code):  # inf is not a Python or Triton name: compare with float("-inf")
        assert re.search(r"[=!]=\s*-?inf\b", hint) is None, hint


@pytest.mark.parametrize("name", list(labs.LABS))
def test_a_wrong_try_prints_no_hint(name, capsys):
    labs.reset_hints()
    labs.check(name, lambda *args: None)
    labs.check(name, raises)
    printed = capsys.readouterr().out
    assert "hint 1 of" not in printed and all(h not in printed for h in labs.LABS[name].hints)
    labs.hint(name)
    assert capsys.readouterr().out.startswith(f"hint 1 of 3 for {name}: ")  # the first one, when asked
    labs.reset_hints()


def test_solution_prints_its_source(capsys):
    labs.solution("merge_states")
    assert capsys.readouterr().out.strip() == labs.solution_source("merge_states").strip()


@pytest.mark.parametrize("call", [labs.check, labs.hint, labs.solution, labs.solution_source])
def test_an_unknown_lab_is_a_value_error_naming_it_and_the_labs(call):
    args = ("flash_forward", None) if call is labs.check else ("flash_forward",)
    with pytest.raises(ValueError, match="'flash_forward', which is not a lab; the labs are online_softmax, "
                                         "merge_states, tiled_forward"):
        call(*args)


def test_result_is_its_verdict():
    result = labs.LabResult("tiled_forward", False, "NOT YET: ...", "no_rescale", 1)
    assert not result and repr(result) == "LabResult('tiled_forward', passed=False, mistake='no_rescale')"


def test_insert_lab_cells_puts_them_before_the_summary_and_twice_changes_nothing(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import insert_lab_cells

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 02", id="a"),
                                         nbformat.v4.new_code_cell("x = 1", id="b"),
                                         nbformat.v4.new_markdown_cell("## Summary\n\n- done", id="c")])
    path = tmp_path / "02_online_softmax.ipynb"
    nbformat.write(nb, path)
    insert_lab_cells.insert(path)
    once = path.read_text()
    insert_lab_cells.insert(path)
    assert path.read_text() == once
    sources = ["".join(c["source"]) for c in json.loads(once)["cells"]]
    assert [cells.marked(s) for s in sources] == [None, None, "online_softmax", "online_softmax", "merge_states",
                                                  "merge_states", None]
    stub = json.loads(once)["cells"][3]
    assert "".join(stub["outputs"][0]["text"]).startswith("NOT YET: no answer yet")
    assert stub["execution_count"] is not None  # nbval refuses stored outputs of a cell never run


# Notebooks run whole, every cell before their labs included. Each lab cell is self-contained (test_labs_fresh
# runs it alone in a fresh kernel); a whole run adds a lab checked after the notebook's own cells changed the
# process: in 06 and 07 they launch the course's Triton kernels in the interpreter (which patches triton.language
# on each launch) before the kernel lab. 06 is run whole for both (07's cells first train with the backward
# kernels for a minute). The others run their setup cell, their lab cells and the reveals, in a kernel of their own.
WHOLE = {"06_fused_forward"}


def _solved(notebook: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the notebook with every lab stub replaced by its solution and the cells after the last lab
    and its reveal dropped (nothing after them depends on them); outside WHOLE, only the setup cell, the labs
    and the reveals are kept."""
    nb = nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4)
    names = cells.lab_names(notebook)
    where = {cells.marked(c.source): i for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    missing = [n for n in names if n not in where]
    assert not missing, f"{notebook} has no lab cell for {missing}: run python tools/insert_lab_cells.py"
    for name in names:
        nb.cells[where[name]].source = cells.code_cell(name, solved=True)
    reveals = [i for i, c in enumerate(nb.cells) if "labs.reveal(" in c.source]
    last = max([where[n] for n in names] + reveals)
    if notebook in WHOLE:
        nb.cells = nb.cells[:last + 1]
    else:
        setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        kept = {setup, *reveals, *(where[n] for n in names)}
        nb.cells = [c for i, c in enumerate(nb.cells) if i in kept]
    path = tmp_path / f"{notebook}.ipynb"
    nbformat.write(nb, path)
    return path, names


@pytest.mark.parametrize("notebook", sorted({spec.notebook for spec in labs.LABS.values()}))
def test_each_notebook_runs_its_labs_with_the_solutions(notebook, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import execute_notebooks

    monkeypatch.setenv("FLASHLIB_PROGRESS", str(tmp_path / "progress.json"))  # the passes: not beside the course

    path, names = _solved(notebook, tmp_path)
    execute_notebooks.execute(path)
    executed = nbformat.read(path, as_version=4)
    passed = []
    for cell in executed.cells:
        name = cells.marked(cell.source) if cell.cell_type == "code" else None
        if name is not None:
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert text.startswith(f"PASS: {name}"), f"{notebook}, lab {name}:\n{text}"
            passed.append(name)
        reveal = re.match(r'labs\.reveal\("(\w+)"\)', cell.source)
        if reveal:  # once the lab passed, the course's own code
            text = "".join(o.get("text", "") for o in cell.outputs)
            for where in labs.LABS[reveal.group(1)].reveal:
                assert f"def {where.split(':')[1]}(" in text, f"{notebook}: {text[:300]}"
    assert passed == names, f"{notebook}: the labs that ran and passed: {passed}"


def stored_cells(notebook: str) -> list:
    return nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4).cells


@pytest.mark.parametrize("notebook", sorted({spec.notebook for spec in labs.LABS.values()}))
def test_the_stored_lab_cells_are_the_catalogs_and_import_nothing_private(notebook):
    stored = {(cells.marked(c.source), c.cell_type): c.source for c in stored_cells(notebook) if cells.marked(c.source)}
    for name in cells.lab_names(notebook):
        assert stored[name, "markdown"] == cells.markdown_cell(name), f"{name}: run python tools/insert_lab_cells.py"
        assert stored[name, "code"] == cells.code_cell(name), f"{name}: run python tools/insert_lab_cells.py"
        for line in stored[name, "code"].splitlines():
            if line.startswith(("import ", "from ")):
                assert re.search(r"\b_\w", line) is None, line


@pytest.mark.parametrize("name", [n for n, spec in labs.LABS.items() if spec.reveal])
def test_nothing_before_a_kernel_lab_prints_the_code_it_asks_for(name):
    nb = stored_cells(labs.LABS[name].notebook)
    lab_at = next(i for i, c in enumerate(nb) if c.cell_type == "code" and cells.marked(c.source) == name)
    shown = "\n".join(c.source + "".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb[:lab_at])
    jit = "@triton.jit\n" if labs.LABS[name].triton else ""  # notebook 06 prints notebook 03's _online_update
    for where in labs.LABS[name].reveal:
        assert f"{jit}def {where.split(':')[1]}(" not in shown
    assert f"def {name}(" not in shown
    revealed = [i for i, c in enumerate(nb) if f'labs.reveal("{name}")' in c.source]
    assert revealed and revealed[0] > lab_at
    assert "printed here once" in "".join(o.get("text", "") for o in nb[revealed[0]].outputs)


@needs_triton
def test_reveal_waits_for_a_pass_or_the_solution(capsys, tmp_path):
    labs.core._SEEN.discard("attn_fwd_inner")
    labs.reveal("attn_fwd_inner")
    assert "printed here once attn_fwd_inner passes labs.check" in capsys.readouterr().out
    labs.check("attn_fwd_inner", edited("attn_fwd_inner", tmp_path, ("l_i = alpha * l_i + ", "l_i = l_i + ")))
    capsys.readouterr()
    labs.reveal("attn_fwd_inner")
    assert "printed here once" in capsys.readouterr().out
    labs.check("attn_fwd_inner", load(labs.solution_source("attn_fwd_inner"), "attn_fwd_inner", tmp_path))
    capsys.readouterr()
    labs.reveal("attn_fwd_inner")
    shown = capsys.readouterr().out
    assert shown.startswith("@triton.jit\ndef _online_update(") and "def _attn_fwd_inner(" in shown
    labs.core._SEEN.discard("attn_bwd_dkdv_inner")
    labs.solution("attn_bwd_dkdv_inner")
    capsys.readouterr()
    labs.reveal("attn_bwd_dkdv_inner")
    assert "def _attn_bwd_dkdv_inner(" in capsys.readouterr().out


@needs_triton
def test_log2e_is_public_and_a_triton_constant():
    import triton.language as tl

    from flashlib.labs import LOG2E

    assert isinstance(LOG2E, tl.constexpr) and abs(LOG2E.value - 1 / math.log(2)) < 1e-15


def _course_code_answers():
    """(lab, answer, how the refusal says it) for answers that are, copy or call the course's own code."""
    import functools
    import inspect

    import flashlib
    import flashlib.tiled
    from flashlib import rules
    from flashlib.backward import tiled_backward as course_backward
    from flashlib.softmax import merge_states

    def via_module_chain(q, k, v, block_q, block_k, causal):
        return flashlib.tiled.tiled_forward(q, k, v, block_q=block_q, block_k=block_k, causal=causal)

    def via_import(q, k, v, out, lse, dout, block_q, block_k, causal):
        return course_backward(q, k, v, out, lse, dout, block_q=block_q, block_k=block_k, causal=causal)

    def make_closure():
        grad = rules.sink_grad

        def sink_grad(sinks, lse, delta):
            return grad(sinks, lse, delta)
        return sink_grad

    @functools.wraps(rules.sink_grad)
    def wrapped(sinks, lse, delta):
        return -rules.sink_grad(sinks, lse, -delta) * -1

    class Merger:
        def __init__(self):
            self.inner = merge_states

        def __call__(self, m_a, l_a, m_b, l_b):
            return self.inner((m_a, l_a), (m_b, l_b))

    copy = {}
    exec(compile(inspect.getsource(rules.sink_grad), "<a copy>", "exec"), vars(rules).copy() | {"__name__": "x"}, copy)
    return [("tiled_forward", via_module_chain, "calls the course's own flashlib.tiled.tiled_forward"),
            ("tiled_backward", via_import, "calls the course's own flashlib.backward.tiled_backward"),
            ("sink_grad", rules.sink_grad, "is the course's own flashlib.rules.sink_grad"),
            ("sink_grad", functools.partial(rules.sink_grad), "is the course's own flashlib.rules.sink_grad"),
            ("sink_grad", make_closure(), "calls the course's own flashlib.rules.sink_grad"),
            ("sink_grad", wrapped, "is the course's own flashlib.rules.sink_grad"),
            ("sink_grad", copy["sink_grad"], "is a copy of the course's own flashlib.rules.sink_grad"),
            ("merge_states", Merger(), "calls the course's own flashlib.softmax.merge_states")]


def test_the_courses_own_code_is_not_an_answer(capsys):
    """The course's function, a copy of its code, or a call to it (through a module's attributes, an
    import, a closure, functools.partial or wraps, a callable object) is refused before any case runs."""
    for name, answer, how in _course_code_answers():
        result = labs.check(name, answer)
        assert not result and result.mistake == "course_code", (name, result.message)
        assert f"your function {how}." in result.message and "write this step yourself" in result.message
    capsys.readouterr()


@needs_triton
def test_the_courses_kernel_loop_is_not_an_answer(tmp_path, capsys):
    import inspect

    from flashlib.kernels import backward, forward

    for name, course in (("attn_fwd_inner", forward._attn_fwd_inner),
                         ("attn_bwd_dkdv_inner", backward._attn_bwd_dkdv_inner)):
        result = labs.check(name, course)  # as notebook 06 hands it: fused._attn_fwd_inner
        assert result.mistake == "course_code" and "is the course's own" in result.message
        # its source pasted into a cell of one's own: the same code
        source = inspect.getsource(course.fn)
        path = tmp_path / f"{name}_copy.py"
        path.write_text("import triton\nimport triton.language as tl\nfrom flashlib.kernels.forward import *\n"
                        "from flashlib.kernels.backward import *\n\n" + source)
        module = {}
        exec(compile(path.read_text(), str(path), "exec"), module)
        result = labs.check(name, module[course.fn.__name__])
        assert result.mistake == "course_code" and "is a copy of the course's own" in result.message, result.message
    capsys.readouterr()
