"""Issue the next tile's scores before this tile's softmax, and see whether the two overlap.

    python tools/experiments/try_software_pipelining.py [DIRECTORY_HOLDING_ANOTHER_TRITON]

FlashAttention-3 overlaps the exponentials of one tile with the tensor cores' work on the
next. This script writes that order into rung 4's unmasked key loop (S for tile j + 1 is
computed before the softmax of tile j; past the end the descriptor reads zeros), compiles
rung 4 and the rewritten kernel for sm_90 (bf16, head dim 128, 64 x 64 tiles, 4 warps) and
reads the machine code: for every group of wgmma instructions (HGMMA), how many exp2
instructions (MUFU) the warps execute between issuing the group and waiting for it
(WARPGROUP.DEPBAR). Overlap needs exponentials in that window. Backs data/bench/LOG.md.
"""
import importlib.util
import inspect
import os
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashlib.kernels.compile import _disassemble, _instructions, _signature  # noqa: E402
from flashlib.ladder import forward as ladder_forward  # noqa: E402
from flashlib.ladder.rungs import rung  # noqa: E402

OLD = """    for k0 in range(0, k_full, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m_i, l_i, acc = FOLD(m_i, l_i, acc, q_blk, k_desc.load([k0, 0]), v_desc.load([k0, 0]), offs_q, offs_k,
                             qk_scale, SEQ_Q, SEQ_K, False, CAUSAL, INPUT_PRECISION)
"""
NEW = """    s_next = tl.dot(q_blk, tl.trans(k_desc.load([0, 0])))
    for k0 in range(0, k_full, BLOCK_K):
        s = s_next
        s_next = tl.dot(q_blk, tl.trans(k_desc.load([k0 + BLOCK_K, 0])))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v_desc.load([k0, 0]))
        m_i = m_new
"""


def exp2_between_issue_and_wait(cubin: bytes) -> list[int]:
    """For each wgmma group, in program order: exp2 instructions between issue and wait."""
    counts, open_group = [], None
    for _, _, op, operands in _instructions(_disassemble(cubin))[0]:
        if op == "HGMMA" and open_group is None:
            open_group = 0
        elif op == "MUFU" and open_group is not None:
            open_group += 1
        elif op == "WARPGROUP" and operands.startswith(".DEPBAR") and open_group is not None:
            counts.append(open_group)
            open_group = None
    return counts


source = inspect.getsource(ladder_forward._attn_fwd_tma.fn)
assert OLD in source, "rung 3/4's unmasked loop changed: update this script"
header = ("import triton\nimport triton.language as tl\n"
          "from flashlib.kernels.forward import _finish\n"
          "from flashlib.kernels.rules import _key_tiles\n"
          "from flashlib.ladder.forward import _query_block\n")
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "pipelined.py")
    with open(path, "w") as f:
        f.write(header + source.replace(OLD, NEW))
    spec = importlib.util.spec_from_file_location("pipelined", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel, options, _ = ladder_forward.variant(rung("lean"), descriptors=True)
    constants = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=64, BLOCK_K=64, CAUSAL=False, INPUT_PRECISION="tf32",
                     **options)
    print(f"Triton {triton.__version__}, sm_90, bf16, head dim 128, 64 x 64 tiles, 4 warps, 3 stages")
    for name, fn in (("rung 4", kernel), ("rung 4, next S issued first", module._attn_fwd_tma)):
        signature, attrs = _signature(fn, "bfloat16", constants)
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        print(f"  {name:28s}: exp2 between each wgmma group's issue and its wait: "
              f"{exp2_between_issue_and_wait(compiled.asm['cubin'])}")
