"""Compile the teaching kernels' variants for GPU targets, on a machine without one, as their launchers bind them.

``python -m tests.variants_compile`` reads JSON specs on stdin and writes one report per kernel
that each spec's launches would run. A spec's forward and backward go through the launchers of
flashlib.kernels.function (or .varlen) under flashlib.bench.ahead.recording(), with a stand-in
driver answering the target (sm_80 or sm_90): Triton's JIT binds and specialises the arguments as
a launch on that GPU would (int32 lengths, a uint8 block mask, a float soft-cap, the mask function
as a compile-time argument, an integer equal to 1 as a constant). Each noted kernel is then
compiled, nothing runs; registers and spills come from the ptxas that ships with Triton.
:func:`compile_variants` starts it with TRITON_INTERPRET=0 (and another Triton release first on
the path, for 3.6.0); tests/test_kernel_compile.py asks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = ("document", "prefix_lm", "plain", "window1")
SCORES = ("alibi", "bias", "t5")


def spec(name: str, capability, dtype: str, head_dim: int, *, causal=False, group=1, window=None, softcap=None,
         mask=None, varlen=False, sass=False, score=None, head_dim_v=None, chunk=None):
    """One forward and backward launch: ``group`` query heads per kv head, a window (left, right),
    a soft-cap, a mask (one of MASKS: masks.document, masks.prefix_lm, masks.causal as a plain def, or
    masks.sliding_window(1), whose number, given at launch, is an integer equal to 1), a score function
    (one of SCORES: flashlib.scores.alibi, relative_bias or t5_relative_bias) and ``varlen``
    for packed sequences; sass: also read each kernel's first tensor-core loop from its machine
    code (flashlib.kernels.compile.first_mma_loop); head_dim_v: v's head dim where it is its own (MLA's); chunk:
    attention_chunk."""
    return dict(name=name, capability=list(capability), dtype=dtype, head_dim=head_dim, causal=causal, group=group,
                window=window, softcap=softcap, mask=mask, varlen=varlen, sass=sass, score=score,
                head_dim_v=head_dim_v, chunk=chunk)


def compile_variants(specs, *, triton_path: str | None = None, timeout: float = 600) -> list[dict]:
    """One report per kernel of every spec, from one fresh Python with TRITON_INTERPRET=0 and
    triton_path first on its path."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "tests.variants_compile"], input=json.dumps(list(specs)),
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"compile_variants: the compiler process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


class StandInDriver:
    """What Triton's JIT asks a driver when it binds a launch: a device (one per target, so that
    each target has its own kernel cache), a stream, the target."""

    def __init__(self):
        self.capability = (9, 0)

    def get_current_device(self):
        return self.capability[0]

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability[0] * 10 + self.capability[1], 32)


def _mask(name, seq):
    import torch

    from flashlib import masks

    if name is None:
        return None
    return {"document": lambda: masks.document(torch.arange(seq) // 100), "prefix_lm": lambda: masks.prefix_lm(64),
            "plain": lambda: masks.causal, "window1": lambda: masks.sliding_window(1)}[name]()


def _score(name, heads, seq):
    import torch

    from flashlib import scores

    if name is None:
        return None
    return {"alibi": lambda: scores.alibi(scores.alibi_slopes(heads)),
            "bias": lambda: scores.relative_bias(torch.zeros(2 * seq - 1)),
            "t5": lambda: scores.t5_relative_bias(torch.zeros(32, heads))}[name]()


def _launch(s):
    """Run the spec's forward and backward launchers on CPU stand-ins (under recording: noted only)."""
    import torch

    from flashlib.kernels import function, varlen
    from flashlib.kernels.config import default_config
    from flashlib.machinery.options import checked_options

    dtype = getattr(torch, s["dtype"])
    cfg = default_config(s["head_dim"], dtype, tuple(s["capability"]), head_dim_v=s.get("head_dim_v"))
    kv_heads, heads, seq, d = 2, 2 * s["group"], 512, s["head_dim"]
    dv = s.get("head_dim_v") or d
    options = checked_options("compile", heads, "cpu", causal=s["causal"], scale=0.1, window=s["window"],
                              softcap=s["softcap"], mask_mod=_mask(s["mask"], seq),
                              score_mod=_score(s.get("score"), heads, seq), attention_chunk=s.get("chunk"))
    if s["varlen"]:
        cu = torch.tensor([0, 200, 512], dtype=torch.int32)
        q, out, dout = (torch.zeros(seq, heads, dim, dtype=dtype) for dim in (d, dv, dv))
        k, v = (torch.zeros(seq, kv_heads, dim, dtype=dtype) for dim in (d, dv))
        lse = torch.zeros(heads, seq)
        varlen._launch_forward(q, k, v, cu, cu, 312, 312, cfg, options)
        varlen._launch_backward(q, k, v, out, lse, dout, None, cu, cu, 312, 312, cfg, options)
        return
    q, out, dout = (torch.zeros(2 * heads, seq, dim, dtype=dtype) for dim in (d, dv, dv))  # (B*H, N, d or dv), B = 2
    k, v = (torch.zeros(2 * kv_heads, seq, dim, dtype=dtype) for dim in (d, dv))
    lse = torch.zeros(2 * heads, seq)
    shape = torch.Size((2, heads, seq, d))
    like = torch.empty(1).expand(shape)  # the (batch, heads, seq, d) shape, for the block mask
    masks = function._masks(options, like, seq, cfg.block_q, cfg.block_k)
    function._launch_forward(q, k, v, cfg, options, heads, masks)
    masks = function._masks(options, like, seq, cfg.bwd_block_q, cfg.bwd_block_k, backward=True)
    function._launch_backward(q, k, v, out, lse, dout, None, cfg, options, heads, masks)


def _compile_note(note, s) -> dict:
    import triton

    from flashlib.kernels.compile import _ptxas_info, _ptxas_path, first_mma_loop, ptxas_log

    report = dict(spec=s["name"], kernel=note.name, capability=s["capability"], triton_version=triton.__version__,
                  ok=False, error="")
    try:
        with ptxas_log() as log:
            compiled = note.kernel.warmup(*note.args, grid=(1,), **note.kwargs)
        ptx = compiled.asm["ptx"]
        registers, stores, loads = _ptxas_info(ptx, _ptxas_path(), log.getvalue())
        report.update(ok=True, shared=int(compiled.metadata.shared), registers=registers, spill_stores=stores,
                      spill_loads=loads, mma_sync_ops=ptx.count("mma.sync"), wgmma_ops=ptx.count("wgmma.mma_async"))
        if s["sass"]:
            report["mma_loop"] = first_mma_loop(compiled.asm["cubin"])
    except Exception as exc:  # reported per kernel, so one failure does not hide the others
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    return report


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit("tests.variants_compile: run with TRITON_INTERPRET=0; interpreted kernels cannot be compiled")
    from triton.runtime.driver import driver

    stand_in = StandInDriver()
    driver.set_active(stand_in)
    from flashlib.bench import ahead

    reports = []
    for s in json.loads(sys.stdin.read()):
        stand_in.capability = tuple(s["capability"])
        with ahead.recording() as notes:
            _launch(s)
        reports += [_compile_note(note, s) for note in notes if note.name != "_attn_bwd_preprocess"]
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    main()
