"""Compile the decoding kernels (flashlib.kernels.decode) for GPU targets on a machine without one.

``python -m tests.decode_compile`` reads JSON specs on stdin and writes one report per spec:
registers, spills, shared memory and tensor-core instructions, as flashlib.kernels.compile
reads them for the attention kernels; and, if asked, compiles decode_forward's own launches
through Triton's JIT (:func:`launch_path`). :func:`compile_decode` starts it with TRITON_INTERPRET=0
(and another Triton release first on the path, for 3.6.0); tests/test_decode.py asks.
The signature is written here: the decoding kernels take int32 pointers (lengths, block table)
and a float soft-cap, which the attention kernels' naming rules do not type.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_POINTERS = {"Partial": "*fp32", "PartialML": "*fp32", "Lse": "*fp32", "Seqs": ("*i32",) * 3, "Table": "*i32",
             "Sinks": "*fp32", "Prefix": "*fp32", "PrefixML": "*fp32"}
# stage 1's strides, one tuple a tensor: q's (sequence, stack, row), the caches' (block, head, row), the partials'
_STRIDES = {"stride_q": 3, "stride_k": 3, "stride_v": 3, "stride_p": 2}


def spec(kernel: str, capability, dtype: str, head_dim: int, *, paged: bool = False, softcap: bool = False,
         rows: int = 4, sinks: bool = False, head_dim_v: int | None = None, v_from_k: bool = False,
         config=None, page_size: int = 16, prefix: bool = False, sass: bool = False, chunk: bool = False):
    """kernel "split" (stage 1) or "merge" (stage 2); rows: stacked query rows (group x new tokens);
    sinks: the merge with attention sinks; head_dim_v: the values' (head_dim by default; the merge's
    width); v_from_k: the values read with the keys (absorbed MLA's view of the latent cache);
    config: stage 1's (block_k, num_warps, num_stages) in place of decode_config's; page_size: a paged
    cache's (a compile-time constant); prefix: the merge folding a shared prefix's splits (cascade);
    sass: also report the loads of stage 1's key loop from the machine code (:func:`key_loop_loads`); chunk:
    stage 1 with attention_chunk (the rule tuple's third integer given, as a launch binds it)."""
    return dict(kernel=kernel, capability=list(capability), dtype=dtype, head_dim=head_dim, paged=paged,
                softcap=softcap, rows=rows, sinks=sinks, head_dim_v=head_dim_v or head_dim, v_from_k=v_from_k,
                config=None if config is None else list(config), page_size=page_size, prefix=prefix, sass=sass,
                **(dict(chunk=True) if chunk else {}))


def spec_of(report: dict, specs) -> dict:
    """The spec (one of ``specs``) a report was compiled from: a report holds its spec's fields, then its findings."""
    keys = set().union(*specs)
    return {key: value for key, value in report.items() if key in keys}


def compiled_once(compiled: dict, specs) -> bool:
    """Whether {version: {"reports": ...}} compiled every spec once, with one of the releases."""
    done = [spec_of(r, specs) for v in compiled for r in compiled[v]["reports"]]
    return len(done) == len(specs) and all(s in done for s in specs)


def compile_decode(specs, *, triton_path: str | None = None, launch: bool = False, bench: bool = True,
                   timeout: float = 600) -> dict:
    """{"reports": one per spec, "launch": :func:`launch_path`'s result (with launch=True) or None},
    from one fresh Python with TRITON_INTERPRET=0 and triton_path first on its path; bench: the launch
    path compiles the decoding benchmark's launches too."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "tests.decode_compile"],
                          input=json.dumps(dict(specs=list(specs), launch=launch, bench=bench)), capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"compile_decode: the compiler process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def _bundle(i: int, bundle, constants: dict):
    """A bundle of kernels/rules.py as the JIT types it, argument ``i``: its functions compile-time constants,
    its tensors' pointers unaligned (none is given here), its integers and floats run-time."""
    from triton.runtime.jit import JITFunction, mangle_type

    def typed(value, path):
        if isinstance(value, tuple):
            items = [typed(v, (*path, j)) for j, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, JITFunction):
            constants[path] = value
            return "constexpr"
        return mangle_type(value)

    return typed(bundle, (i,))


def _signature(fn, dtype: str, constants: dict, runtime: dict):
    """runtime: arguments typed by their value, as the JIT types them (the mask and score bundles)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in runtime:
            signature[name] = _bundle(i, runtime[name], constants)
        elif name in _POINTERS or name in ("Q", "K", "V", "Out"):
            signature[name] = _POINTERS.get(name, f"*{_TYPES[dtype]}")
            parts = range(len(signature[name])) if isinstance(signature[name], tuple) else [None]
            attrs.update({(i,) if j is None else (i, j): [["tt.divisibility", 16]] for j in parts})
        elif name in ("qk_scale", "scale"):
            signature[name] = "fp32"
        elif name in _STRIDES:  # as the JIT sees multiples of 16
            signature[name] = ("i32",) * _STRIDES[name]
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(_STRIDES[name])})
        else:
            signature[name] = "i32"
            if name.startswith("stride") or name in ("HEAD_DIM", "HEAD_DIM_V"):  # as the JIT sees multiples of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _kernel(s):
    import torch

    from flashlib.kernels import decode
    from flashlib.kernels.config import head_dim_pad

    d, dv = s["head_dim"], s.get("head_dim_v") or s["head_dim"]
    block_q = decode.row_block(s["rows"], dv, tuple(s["capability"]))
    if s["kernel"] == "merge":  # its HEAD_DIM is the output's, the values' head dim
        block_q = decode.row_block(s["rows"], dv)  # stage 2: no capability, no tensor cores
        sinks = {} if s.get("sinks") else dict(Sinks=None)  # a launch without sinks passes None
        prefix = {} if s.get("prefix") else dict(Prefix=None, PrefixML=None)
        return (decode._decode_merge, dict(HEAD_DIM_PAD=head_dim_pad(dv), BLOCK_Q=block_q, **sinks, **prefix),
                dict(num_warps=s.get("merge_warps") or decode.merge_warps(dv), num_stages=1), {})
    v_from_k = bool(s.get("v_from_k"))
    d_pad = head_dim_pad(d - dv) if v_from_k else head_dim_pad(d)  # as decode.DecodeLaunch pads
    cfg = (decode.DecodeConfig(*s["config"]) if s.get("config") else
           decode.decode_config(d, getattr(torch, s["dtype"]), tuple(s["capability"]), head_dim_v=dv, paged=s["paged"]))
    from flashlib.kernels.function import kernel_score
    from flashlib.kernels.rules import mask_bundle, score_bundle
    from flashlib.machinery.options import Options

    score = score_bundle(kernel_score(Options(softcap=30.0 if s["softcap"] else 0.0), "cpu"))  # a score function
    constants = dict(HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=head_dim_pad(dv), BLOCK_Q=block_q, BLOCK_K=cfg.block_k,
                     KEY_ROWS=decode._paged_rows if s["paged"] else decode._contiguous_rows,
                     PAGE_SIZE=s.get("page_size", 16) if s["paged"] else 1, INPUT_PRECISION="tf32", V_FROM_K=v_from_k)
    # the rule as a launch binds it: the window's sides (-1: none) run-time integers, a chunk a third
    runtime = dict(mask=mask_bundle(Options.of(attention_chunk=8192 if s.get("chunk") else 0),
                                    always=True))
    if score is None:
        constants["score"] = None  # what a launch without one passes: a compile-time None
    else:
        runtime["score"] = score
    return decode._decode_split, constants, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), runtime


def _compile_one(s) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashlib.kernels.compile import _first_mma_loop, _instructions, _disassemble, _ptxas_info, _ptxas_path, ptxas_log

    report = dict(s, triton_version=triton.__version__, ok=False, error="")
    try:
        fn, constants, options, runtime = _kernel(s)
        signature, attrs = _signature(fn, s["dtype"], constants, runtime)
        cc = s["capability"][0] * 10 + s["capability"][1]
        with ptxas_log() as log:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", cc, 32), options=options)
        ptx = compiled.asm["ptx"]
        registers, stores, loads = _ptxas_info(ptx, _ptxas_path(), log.getvalue())
        report.update(ok=True, shared=int(compiled.metadata.shared), registers=registers, spill_stores=stores,
                      spill_loads=loads, mma_sync_ops=ptx.count("mma.sync"), wgmma_ops=ptx.count("wgmma.mma_async"),
                      num_warps=options["num_warps"], num_stages=options["num_stages"])
        if s.get("sass"):  # stage 1's key loop in the machine code: its length and its global loads
            loop = _first_mma_loop(*_instructions(_disassemble(compiled.asm["cubin"])))
            report["key_loop"] = dict(body=loop["body"], loads=loop["loads"], ops=loop["ops"])
    except Exception as exc:  # reported per spec, so one failure does not hide the others
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    return report


def decode_forward(q, k_cache, v_cache, cache_seqlens, *, options, score=None, block_table=None, num_splits=None,
                   config=None):
    """flashlib.kernels.decode's two stages on inputs flashlib.decode_attention would have checked, every
    sequence with q's new tokens from position 0: a DecodeLaunch made and called once; (out, lse)."""
    import torch

    from flashlib.kernels.decode import DecodeLaunch, as_kernels_read
    from flashlib.kvcache import Batch

    lengths = cache_seqlens
    x = as_kernels_read(Batch(q, k_cache, v_cache, block_table, lengths, torch.full_like(lengths, q.shape[2]),
                              torch.zeros_like(lengths), None, None))
    launch = DecodeLaunch(q, x.k_cache, x.v_cache, options=options, score=score, block_table=x.block_table,
                          num_splits=num_splits, config=config, new_tokens=x.new_tokens, starts=x.starts)
    return launch(q, x.k_cache, x.v_cache, x.seqlens, x.block_table)


def launch_path(bench: bool = True) -> dict:
    """decode_forward's own launches, bound by Triton's JIT as on an H200 and compiled, nothing run:
    a stand-in driver answers which device, stream and target (sm_90), flashlib.bench.ahead notes
    the launches and compiles them through the JIT's warm-up entry (its argument binder and
    specialisation: the row function passed as a compile-time argument, int32 pointers, a float
    soft-cap, integers equal to 1). CPU tensors stand in for the GPU's; nothing reads them. bench: the
    decoding benchmark's compiling ahead too (runs and bench_ahead; None without)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(StandInDriver())
    from flashlib.bench import ahead
    from flashlib.decode import paged_cache
    from flashlib.kernels import decode

    q = torch.zeros(2, 32, 1, 128, dtype=torch.bfloat16)  # (batch, q_heads, new tokens, head_dim)
    k = torch.zeros(2, 8, 4096, 128, dtype=torch.bfloat16)  # (batch, kv_heads, capacity, head_dim)
    k_pages, _, table = paged_cache(k, k, 16)
    lengths = torch.full((2,), 4096, dtype=torch.int32)
    config = decode.decode_config(128, torch.bfloat16, (9, 0))
    with ahead.recording() as notes:
        from flashlib.machinery.options import Options

        # a value cache of its own, then (paged) the keys' own tensor as values: both stage-1 paths
        decode_forward(q, k, torch.zeros_like(k), lengths, options=Options.of(causal=True, scale=0.1), num_splits=33, config=config)
        from flashlib.kernels.function import kernel_score
        from flashlib.machinery.options import Options

        decode_forward(q, k_pages, k_pages, lengths, options=Options.of(causal=True, scale=0.1, window=(256, -1)), block_table=table,
                       score=kernel_score(Options(softcap=30.0), "cpu"), num_splits=1, config=config)
    compiled = ahead.compile_notes(notes, threads=2)
    if not bench:
        return dict(notes=[n.name for n in notes], compiled=compiled, runs=None, bench_ahead=None)
    # the decoding benchmark's own compiling ahead, for a few of its points and sweep items
    from flashlib.bench import decode as bench

    shapes = dict(q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cpu")
    items = [bench.plan()[0], bench.plan()[1], *bench.sweep_items()[:2], bench.sweep_items()[-1]]
    runs = [bench.what_runs(p, q_heads=32, kv_heads=8, device="cpu") for p in items]
    # and its plans' (a cascade group, an MLA step), made by the public classes: their checks of q's device
    # are this stand-in's (CPU tensors standing in for the GPU's)
    import flashlib.decode

    flashlib.decode._check_kernel_q = lambda fn, q: None
    groups = bench.cascade_items(groups=(8,), prefixes=(4096,))
    steps = bench.mla_items(batches=(2,), lengths=(256,))
    bench_ahead = bench.compile_ahead(runs, threads=2, log=lambda *_: None, groups=groups, steps=steps, **shapes)
    return dict(notes=[n.name for n in notes], compiled=compiled, runs=[list(map(str, r)) for r in runs],
                bench_ahead=bench_ahead)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit("tests.decode_compile: run with TRITON_INTERPRET=0; interpreted kernels cannot be compiled")
    asked = json.loads(sys.stdin.read())
    json.dump(dict(reports=[_compile_one(s) for s in asked["specs"]],
                   launch=launch_path(asked["bench"]) if asked["launch"] else None), sys.stdout)
