"""Compile the kernels for a GPU target on any Linux machine, GPU or not, and inspect them.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs Triton's whole
pipeline (Triton IR -> GPU IR -> LLVM -> PTX -> cubin) without a driver. From its output we
read what a student should see: the tensor-core instructions in the PTX (``mma.sync`` on
sm_80, ``wgmma`` on sm_90; Triton gives sm_75 none), the shared memory the kernel needs, and, from the ptxas
that ships with Triton, registers and spills.

Interpreted kernels cannot be compiled, so :func:`compile_kernels` runs the compiler in a
subprocess with ``TRITON_INTERPRET=0`` (optionally with another Triton first on the path);
``python -m flashlib.kernels.compile`` is that subprocess: JSON specs in, JSON reports out.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

# Shared memory per block a kernel may use (opt-in maximum), bytes.
SHARED_LIMIT = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024,
                (9, 0): 227 * 1024}
KERNELS = ("forward", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "softmax", "vector_add")
_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class TargetReport:
    """What one kernel looks like compiled for one GPU target (without a GPU)."""

    capability: tuple[int, int]
    dtype: str
    head_dim: int
    causal: bool
    config: dict = field(default_factory=dict)
    triton_version: str = ""
    ok: bool = False
    error: str = ""
    shared: int = 0                 # bytes of shared memory per program
    registers: int = 0              # per thread, from ptxas -v
    spill_stores: int = 0           # bytes, from ptxas -v
    spill_loads: int = 0
    wgmma_ops: int = 0              # wgmma.mma_async instructions in the PTX (Hopper)
    mma_sync_ops: int = 0           # mma.sync instructions in the PTX (Ampere, and Hopper's small tiles)
    bulk_copy_ops: int = 0          # TMA copies (cp.async.bulk.tensor) in the PTX (Hopper)
    bulk_reduce_ops: int = 0        # TMA reductions (cp.reduce.async.bulk.tensor) in the PTX
    sass_ops: dict = field(default_factory=dict)  # opcode -> count in the machine code, when asked for
    mma_loop: dict = field(default_factory=dict)  # first_mma_loop() of the machine code, when asked for
    # addresses of wgmma instructions whose operand descriptors come from kernel arguments, when asked for
    wgmma_from_arguments: list = field(default_factory=list)


@dataclass
class CompileReport(TargetReport):
    """One of flashlib's kernels (see KERNELS), compiled for one target."""

    kernel: str = field(default="", kw_only=True)
    ptx_lines: int = 0
    ptx: str = field(default="", repr=False)


def target_spec(who: str, capability, dtype, head_dim, causal, config) -> dict:
    """The fields every compile spec has, checked (dtype a name of _DTYPE_NAMES, config a dict or None)."""
    dtype = str(dtype).replace("torch.", "")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{who}: argument 'dtype' must be one of {tuple(_DTYPE_NAMES)}, got {dtype!r}")
    if config is not None and not isinstance(config, dict):
        config = asdict(config)
    return dict(capability=tuple(capability), dtype=dtype, head_dim=int(head_dim), causal=bool(causal), config=config)


def spec(kernel: str, capability=(9, 0), dtype="float16", head_dim=64, causal=False, config=None, ones=(),
         sass: bool = False, sinks: bool = False, head_dim_v: int | None = None):
    """A JSON-able description of one compilation; config is a FlashConfig or its dict. ones: integer
    arguments (e.g. "SEQ_Q", "HEAD_DIM") passed as the constant 1, as Triton's JIT does when a launch
    passes 1 (a single query, head_dim 1). sass: also count the machine instructions (CompileReport.sass_ops,
    .mma_loop). sinks: the forward with attention sinks (their float32 pointer), not the default launch's
    None. head_dim_v: v's head dim where it is its own (MLA's 128 beside 192); None: head_dim's."""
    if kernel not in KERNELS:
        raise ValueError(f"spec: argument 'kernel' must be one of {KERNELS}, got {kernel!r}")
    return dict(kernel=kernel, **target_spec("spec", capability, dtype, head_dim, causal, config), ones=list(ones),
                sass=bool(sass), sinks=bool(sinks), head_dim_v=None if head_dim_v is None else int(head_dim_v))


def run_compiler(module: str, report, specs, triton_path: str | None, timeout: float, *args) -> list:
    """``python -m module *args`` in a fresh Python without the interpreter, specs in, one ``report`` each out;
    triton_path (e.g. a ``pip install --target`` of another Triton version) first on its PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", module, *args], input=json.dumps(list(specs)), capture_output=True,
                          text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{module}: the compiler process failed:\n{done.stderr[-4000:]}")
    return [report(**{**r, "capability": tuple(r["capability"])}) for r in json.loads(done.stdout)]


def compile_kernels(specs, *, triton_path: str | None = None, keep_ptx: bool = False, timeout: float = 900):
    """Compile every spec (:func:`run_compiler`); return a list of CompileReport."""
    return run_compiler("flashlib.kernels.compile", CompileReport, specs, triton_path, timeout,
                        *(["--ptx"] if keep_ptx else []))


# the teaching kernels take each tensor's strides as one tuple, (head or token, row or head); the ladder's
# kernels take them one by one
STRIDE_TUPLES = {f"stride_{t}": 2 for t in ("q", "k", "v", "o", "do", "dk", "dv", "dq")}


def _with_defaults(fn, constexprs: dict, bundles=()) -> dict:
    """Every compile-time parameter of fn: given, or its default (as a launch would use). One
    missing without a default is an error: compiled as a runtime integer, a flag tested with
    ``if FLAG:`` would quietly build both branches. A parameter that defaults to None (a bundle of
    kernels/rules.py: ``mask``, ``score``) is a compile-time None unless named in ``bundles``."""
    out = dict(constexprs)
    for param in getattr(fn, "params", ()):  # none: not a JIT function (nothing to check)
        if param.name not in out and param.name not in bundles and param.default is None:
            out[param.name] = None  # what a launch without that variant passes
        if param.is_constexpr and param.name not in out:
            if param.default is inspect.Parameter.empty:
                raise ValueError(f"compile: {fn.__name__} needs the compile-time argument {param.name!r}")
            out[param.name] = param.default
    return out


def _sinks_bundle(i: int, constexprs: dict, attrs: dict):
    """The score bundle of a forward with attention sinks alone (kernels/rules.py), as argument ``i``: its
    type, its function compiled in, its float32 pointer 16-byte aligned."""
    from .rules import ScoreBundle, _no_score

    constexprs[(i, 0)] = _no_score
    attrs[(i, 2, 0)] = [["tt.divisibility", 16]]
    return ScoreBundle("constexpr", (), ("*fp32",))


def _signature(fn, dtype: str, constexprs: dict, float32=()):
    """Argument types as the JIT would infer them; pointer and stride args 16-byte aligned.
    float32: pointer arguments that hold float32 whatever the dtype (besides Lse and Delta); "Sinks" among
    them: the score bundle holds attention sinks."""
    float_ptrs = {"Lse", "Delta", *float32}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "score" and "Sinks" in float32:
            signature[name] = _sinks_bundle(i, constexprs, attrs)
        elif name[0].isupper() and not name.isupper() or name in ("Q", "K", "V", "DO", "DK", "DV", "DQ", "X", "Y"):
            signature[name] = "*fp32" if name in float_ptrs else f"*{_DTYPE_NAMES[dtype]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "scale"):
            signature[name] = "fp32"
        elif name in STRIDE_TUPLES:  # a tensor's strides, one tuple: each a multiple of 16, as the JIT sees them
            signature[name] = ("i32",) * STRIDE_TUPLES[name]
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(STRIDE_TUPLES[name])})
        else:
            signature[name] = "i32"
            if name.startswith("stride") or name in ("HEAD_DIM", "HEAD_DIM_V"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def spec_config(s):
    """The spec's FlashConfig, else the shipped one for its head dims, dtype and target."""
    import torch

    from .config import FlashConfig, default_config

    if s["config"]:
        return FlashConfig(**s["config"])
    return default_config(s["head_dim"], getattr(torch, s["dtype"]), tuple(s["capability"]),
                          head_dim_v=s.get("head_dim_v"))


def launch_tiles(cfg, backward: bool):
    """({BLOCK_Q, BLOCK_K}, {num_warps, num_stages}) of a FlashConfig's forward or backward kernels."""
    prefix = "bwd_" if backward else ""
    return (dict(BLOCK_Q=getattr(cfg, prefix + "block_q"), BLOCK_K=getattr(cfg, prefix + "block_k")),
            dict(num_warps=getattr(cfg, prefix + "num_warps"), num_stages=getattr(cfg, prefix + "num_stages")))


def _kernel_and_constants(s):
    """(kernel, compile-time arguments, options, FlashConfig or None, float32 pointers) of a spec, as the
    launchers pass them."""
    from .config import head_dim_pad, value_dim

    ones = {name: 1 for name in s.get("ones", ())}
    float32 = ("Sinks",) if s.get("sinks") else ()  # the forward's score bundle holds sinks alone
    if s["kernel"] in ("softmax", "vector_add"):
        from . import primer

        fn = primer._softmax_kernel if s["kernel"] == "softmax" else primer._add_kernel
        return fn, {"BLOCK": head_dim_pad(s["head_dim"]), **ones}, dict(num_warps=4, num_stages=1), None, float32
    from . import backward, forward

    cfg = spec_config(s)
    values = value_dim(s["head_dim"], s.get("head_dim_v") or s["head_dim"])  # as the launchers pass them
    tiles, options = launch_tiles(cfg, backward=s["kernel"] != "forward")
    if s["kernel"] == "bwd_preprocess":
        constants = dict(HEAD_DIM_PAD=values["HEAD_DIM_V_PAD"], BLOCK_Q=tiles["BLOCK_Q"])
        return backward._attn_bwd_preprocess, {**constants, **ones}, dict(num_warps=4, num_stages=1), cfg, float32
    fn = dict(forward=forward._attn_fwd, bwd_dkdv=backward._attn_bwd_dkdv, bwd_dq=backward._attn_bwd_dq)[s["kernel"]]
    constants = dict(HEAD_DIM_PAD=head_dim_pad(s["head_dim"]), **values, CAUSAL=s["causal"],
                     INPUT_PRECISION=cfg.input_precision, **tiles)
    return fn, {**constants, **ones}, options, cfg, float32


def _usage(text: str):
    """(registers, spill store bytes, spill load bytes) from a ptxas -v log, or None without them."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return None if regs is None or spills is None else (int(regs.group(1)), int(spills.group(1)), int(spills.group(2)))


def _ptxas_info(ptx: str, ptxas: str, log: str = ""):
    """(registers, spill store bytes, spill load bytes): read from ``log``, the ptxas -v output of the
    compile that made the cubin (:func:`ptxas_log`), where it has them; else from the bundled ptxas
    run again on the PTX (a compile Triton found in its cache ran no ptxas)."""
    if _usage(log) is None:
        arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
        done = _run_tool(ptxas, ptx, ".ptx", "-v", f"--gpu-name={arch}", "-o", os.devnull)
        log = done.stdout + done.stderr
    return _usage(log)


def _run_tool(tool: str, data, suffix: str, *args):
    """The finished run of ``tool args file``, the file holding ``data``; RuntimeError if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k" + suffix)
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        done = subprocess.run([tool, *args, path], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{os.path.basename(tool)} failed: {(done.stdout + done.stderr)[-2000:]}")
    return done


@contextlib.contextmanager
def ptxas_log():
    """Collect the ptxas -v log of the compiles inside (Triton prints it with its dump_ptxas_log knob),
    so that registers and spills come from the cubin's own ptxas run rather than a second one:
    ``with ptxas_log() as log: ...; _ptxas_info(ptx, path, log.getvalue())``."""
    from triton import knobs

    buffer, before = io.StringIO(), knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buffer):
            yield buffer
    finally:
        knobs.nvidia.dump_ptxas_log = before


def _ptxas_path():
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _disassemble(cubin: bytes) -> str:
    # -ndf: no dataflow analysis, which Triton's cubins switch off anyway ("Old format"): the same text, 30% sooner
    return _run_tool(os.path.join(os.path.dirname(_ptxas_path()), "nvdisasm"), cubin, ".cubin", "-c", "-ndf").stdout


# "/*0a50*/   @!P0 FFMA.FTZ R4, R5, R6, -R7 ;": an address, an optional predicate, the opcode
_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*)")


def _instructions(sass: str):
    """[(address, predicated, opcode, operands)] and {label: address} of a disassembly."""
    rows, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = _SASS_LINE.match(line)
        if m:
            labels.update(dict.fromkeys(pending, int(m.group(1), 16)))
            pending = []
            rows.append((int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4)))
    return rows, labels


def _opcode_counts(rows) -> dict:
    return dict(collections.Counter(op for _, _, op, _ in rows))


def first_mma_loop(cubin: bytes) -> dict:
    """The first loop of the machine code that holds tensor-core instructions (for the attention
    kernels: the unmasked key loop), read from its disassembly; ValueError if there is none. Returns
    {"body": instructions from the loop's head to its back branch, "short": the same when every forward
    branch that stays inside the body is taken (the fewest a trip can execute), "ops": opcode counts of
    the body, "skippable": opcode counts of what those branches jump over, "loads": the body's global
    loads by opcode and modifiers (:func:`global_loads`)}."""
    return _first_mma_loop(*_instructions(_disassemble(cubin)))


def _first_mma_loop(rows, labels) -> dict:
    target = lambda operands: labels.get((re.search(r"(\.L_x_\d+)", operands) or [None, None])[1])  # noqa: E731
    for i, (address, _, op, operands) in enumerate(rows):
        head = target(operands) if op == "BRA" else None
        if head is None or head >= address:
            continue  # not a back branch
        body = [r for r in rows[:i + 1] if r[0] >= head]
        if not any(r[2] in ("HGMMA", "HMMA") for r in body):
            continue
        skipped = set()
        for a, predicated, o, ops in body:
            end = target(ops) if o == "BRA" and predicated else None
            if end is not None and a < end <= address:
                skipped.update(r[0] for r in body if a < r[0] < end)
        return dict(body=len(body), short=len(body) - len(skipped), ops=_opcode_counts(body),
                    skippable=_opcode_counts([r for r in body if r[0] in skipped]), loads=global_loads(body))
    raise ValueError("first_mma_loop: no loop with tensor-core instructions in this kernel")


def global_loads(rows) -> dict:
    """The global-memory loads among machine instructions, by opcode and modifiers: {"LDG.E.128": n,
    "LDGSTS.E.BYPASS.128": n, "LDGSTS.E": n, ...}. A trailing number is the width in bits of what each
    thread loads (none: 32); LDGSTS copies global to shared memory asynchronously (cp.async), LDG to
    registers."""
    found = collections.Counter()
    for _, _, op, operands in rows:
        if op in ("LDG", "LDGSTS"):
            modifiers = operands.split()[0] if operands.startswith(".") else ""
            found[op + modifiers] += 1
    return dict(found)


def exponentials_per_score(mma_loop: dict, rows: int, cols: int, warps: int) -> float:
    """Exponentials (MUFU instructions) in one trip of a kernel's first tensor-core loop
    (:func:`first_mma_loop`) per score of its (rows, cols) tile that each thread holds: about 1 (a
    row's rescale is one more); 2 or more when Triton holds every score twice (a tile with fewer
    rows than 16 per warp whose probabilities feed another product, split by rows only)."""
    return mma_loop["ops"].get("MUFU", 0) / (rows * cols / (32 * warps))


# ----- where a wgmma's shared-memory operands come from --------------------------------------

# sm_90's kernel arguments start at this offset of constant bank 0 (below it: the driver's own words)
_FIRST_ARGUMENT = 0x210
_UREG = re.compile(r"-?UR(\d+)(?:\.reuse)?")


def _uniform_step(row):
    """(uniform registers written, operands read) of one instruction, or None if it writes none.
    A ".64" or "WIDE" instruction writes, and reads, register pairs."""
    _, _, op, operands = row
    text = operands.strip()
    modifiers, _, text = text.partition(" ") if text.startswith(".") else ("", "", text)
    args = [a.strip() for a in text.split(",") if a.strip()]
    first = _UREG.fullmatch(args[0]) if args and (op.startswith("U") or op in ("R2UR", "S2UR", "VOTEU")) else None
    if first is None:
        return None
    wide = ".64" in modifiers or "WIDE" in modifiers
    n = int(first.group(1))
    return ((n, n + 1) if wide else (n,)), args[1:], wide


def _register_sources(rows, defs, use: int, reg: int, seen: set) -> set:
    """defs: {uniform register: [row index of each instruction that writes it]}, in address order.
    What uniform register ``reg`` holds at row ``use``, traced back to its leaves: "argument"
    (a kernel argument), "block index" (SR_CTAID), or nothing for the rest (constants, the
    shared window's base, values from per-thread registers). The writer taken is the last one
    before the use in address order, else (a value carried around a loop) the last one; a
    predicated writer adds the one before it."""
    written = defs.get(reg, [])
    before = [i for i in written if rows[i][0] < rows[use][0]] or written[-1:]
    chain = before[-1:]
    while chain and rows[chain[-1]][1] and len(before) > len(chain):
        chain.append(before[-len(chain) - 1])
    found = set()
    for i in chain:
        if (i, reg) in seen:
            continue
        seen.add((i, reg))
        _, sources, wide = _uniform_step(rows[i])
        for source in sources:
            constant = re.fullmatch(r"c\[0x0\]\[(0x[0-9a-f]+)\]", source)
            if constant and int(constant.group(1), 16) >= _FIRST_ARGUMENT:
                found.add("argument")
            elif "SR_CTAID" in source:
                found.add("block index")
            elif _UREG.fullmatch(source):
                n = int(_UREG.fullmatch(source).group(1))
                for r in ((n, n + 1) if wide else (n,)):
                    found |= _register_sources(rows, defs, i, r, seen)
    return found


def wgmma_descriptors_from_arguments(rows) -> list:
    """Addresses of the wgmma instructions (HGMMA) whose shared-memory matrix descriptor is
    computed from a kernel argument or the block index, in a disassembly's rows
    (:func:`_instructions`). A descriptor holds a shared-memory address: it can only come from
    the shared window's base, the warp and the pipeline stage. One built from an argument was
    mis-assembled, and reads whatever that argument's value points at: ptxas 12.8 (which both
    Triton 3.6 and 3.7 ship) does so for a product of the fused backward on one tile."""
    defs: dict = {}
    for i, row in enumerate(rows):
        step = _uniform_step(row)
        for reg in step[0] if step else ():
            defs.setdefault(reg, []).append(i)
    wrong = []
    for i, (address, _, op, operands) in enumerate(rows):
        if op != "HGMMA":
            continue
        args = [a.strip() for a in operands.strip().partition(" ")[2].split(",")]
        descriptor = next((a for a in args if a.startswith("gdesc[")), None)
        if descriptor is None:
            continue
        base = int(_UREG.search(descriptor).group(1))
        # gdesc[URn]: n, n+1 describe A when A is in shared memory too, n+2, n+3 describe B
        regs = range(base if args[1].startswith("gdesc[") else base + 2, base + 4)
        if any(_register_sources(rows, defs, i, reg, set()) for reg in regs):
            wrong.append(address)
    return wrong


def compile_and_inspect(report, fn, dtype: str, constants: dict, options: dict, capability,
                        sass: bool = False, float32=()) -> str:
    """Compile ``fn`` for a CUDA target without a GPU; fill the report's shared memory,
    registers, spills and tensor-core instruction counts (and, with sass, the count of every
    machine instruction and the wgmma instructions whose operands' descriptors come from kernel
    arguments); return the PTX. float32: pointer arguments holding float32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = _with_defaults(fn, constants, ("score",) if "Sinks" in float32 else ())
    signature, attrs = _signature(fn, dtype, constants, float32)
    with ptxas_log() as log:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32), options=options)
    ptx = compiled.asm["ptx"]
    report.shared = int(compiled.metadata.shared)
    report.registers, report.spill_stores, report.spill_loads = _ptxas_info(ptx, _ptxas_path(), log.getvalue())
    report.wgmma_ops, report.mma_sync_ops, report.bulk_copy_ops, report.bulk_reduce_ops = (
        ptx.count(op) for op in ("wgmma.mma_async", "mma.sync", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor"))
    if sass:  # one disassembly for both counts
        rows, labels = _instructions(_disassemble(compiled.asm["cubin"]))
        report.sass_ops = _opcode_counts(rows)
        report.wgmma_from_arguments = wgmma_descriptors_from_arguments(rows)
        try:
            report.mma_loop = _first_mma_loop(rows, labels)
        except ValueError:  # a kernel without tensor-core loops (the primer's softmax, say)
            report.mma_loop = {}
    return ptx


def compile_spec(report, s, build, keep_ptx: bool = False, **name) -> dict:
    """Compile what ``build(s)`` names, (kernel, compile-time arguments, options, FlashConfig or None,
    float32 pointers), into a ``report`` class's JSON-able dict; ``name``: its kernel's or rung's field."""
    import triton

    report = report(**name, capability=tuple(s["capability"]), dtype=s["dtype"], head_dim=s["head_dim"],
                    causal=s["causal"], config=s["config"] or {}, triton_version=triton.__version__)
    try:
        fn, constants, options, cfg, float32 = build(s)
        if cfg is not None:
            report.config = asdict(cfg)
        ptx = compile_and_inspect(report, fn, s["dtype"], constants, options, s["capability"],
                                  sass=s.get("sass", False), float32=float32)
        if isinstance(report, CompileReport):  # count the code only: the debug sections after it spell out paths
            report.ptx_lines = ptx.split("\n\t.file", 1)[0].count("\n")
            report.ptx = ptx if keep_ptx else ""
        report.ok = True
    except Exception as exc:  # reported per spec, so one failure does not hide the others
        report.error = f"{type(exc).__name__}: {exc}"[:2000]
    return dict(asdict(report), capability=list(report.capability))


def serve(compile_one):
    """The compiler process: JSON specs on stdin, ``compile_one(spec)`` of each as JSON on stdout."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit(f"{sys.argv[0]}: run with TRITON_INTERPRET=0; interpreted kernels cannot be compiled")
    os.environ["TRITON_INTERPRET"] = "0"
    json.dump([compile_one(s) for s in json.loads(sys.stdin.read())], sys.stdout)


if __name__ == "__main__":
    serve(lambda s: compile_spec(CompileReport, s, _kernel_and_constants, "--ptx" in sys.argv, kernel=s["kernel"]))
