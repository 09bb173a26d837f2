"""Ask Triton to warp-specialise rung 3's unmasked key loop and compile it for sm_90, no GPU needed.

    python tools/experiments/try_warp_specialize.py [DIRECTORY_HOLDING_ANOTHER_TRITON]

Builds a copy of ``flashlib.ladder.forward._attn_fwd_tma`` whose first key loop is
``tl.range(..., warp_specialize=True)`` and compiles it (bf16, head dim 128, causal) with three
tile choices, printing registers, spills, shared memory, wgmma count and whether the PTX
holds ``setmaxnreg`` (the register hand-off between producer and consumer warps that warp
specialisation emits). Backs the sentence in notebook 08 and data/bench/LOG.md.
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

from flashlib.kernels.compile import compile_and_inspect  # noqa: E402
from flashlib.ladder import forward as ladder_forward  # noqa: E402
from flashlib.ladder.compile import RungReport  # noqa: E402
from flashlib.ladder.rungs import rung  # noqa: E402

LOOP = "for k0 in range(0, k_full, BLOCK_K):"
source = inspect.getsource(ladder_forward._attn_fwd_tma.fn)
assert LOOP in source, "rung 3's unmasked loop changed: update this script"
source = source.replace(LOOP, "for k0 in tl.range(0, k_full, BLOCK_K, warp_specialize=True):", 1)
header = ("import triton\nimport triton.language as tl\n"
          "from flashlib.kernels.forward import _finish\n"
          "from flashlib.kernels.rules import _key_tiles\n"
          "from flashlib.ladder.forward import _query_block\n")
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ws_kernel.py")
    with open(path, "w") as f:
        f.write(header + source)
    spec = importlib.util.spec_from_file_location("ws_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(f"Triton {triton.__version__}, sm_90, bf16, head dim 128, causal, warp_specialize=True on the unmasked loop")
    for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3)):
        report = RungReport(rung="tma+ws", capability=(9, 0), dtype="bfloat16", head_dim=128, causal=True)
        constants = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=bm, BLOCK_K=bn, CAUSAL=True, INPUT_PRECISION="tf32",
                         **ladder_forward.variant(rung("tma"), descriptors=True)[1])
        try:
            ptx = compile_and_inspect(report, module._attn_fwd_tma, "bfloat16", constants,
                                      dict(num_warps=warps, num_stages=stages), (9, 0))
            print(f"  tiles {bm}x{bn}, {warps} warps, {stages} stages: {report.registers} registers, "
                  f"{report.spill_stores} B spilled, {report.shared} B shared, {report.wgmma_ops} wgmma, "
                  f"setmaxnreg {'present' if 'setmaxnreg' in ptx else 'absent'}")
        except Exception as exc:  # the pass may fail outright: that is a result too
            print(f"  tiles {bm}x{bn}, {warps} warps, {stages} stages: compilation failed "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
