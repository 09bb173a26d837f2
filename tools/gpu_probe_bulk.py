"""The ladder's bulk backward on a GPU, one case per process: does it fault, is it right?

    PYTHONPATH=. python tools/gpu_probe_bulk.py            # every case, within 150 s
    PYTHONPATH=. python tools/gpu_probe_bulk.py --self-test  # the probe's own plumbing, no GPU needed

A kernel that makes an illegal memory access leaves its process unable to use the GPU, so each
case runs in a process of its own (``--case NAME``), several at once, and the parent reads one
JSON line from each. A case is "ok" when its output and its three gradients are within flash-attn's
rule (error against a float32 SDPA at most twice SDPA's own in the same 16-bit dtype, plus 1e-4),
"wrong" when one is not, "fault" when the kernel made an illegal access (or the process died on a
signal), "error" for any other exception and "timeout" past the deadline. With compute-sanitizer on
PATH the withdrawn tile's case also runs once under its memcheck tool (at most 90 s), and the tail of
its report is kept. Results go to $OUT/bulk-probe.json (a temporary folder without OUT), rewritten
after every case so that a killed probe still leaves what it found.

The cases: the shapes where the bulk backward faulted on an H200 (d = 128, bfloat16, causal,
1 x 4 x 4096; float16, not causal, N = 8192) with the tiles the autotuner offers now, head dim 64,
a ragged length, the transposed tile that stays, and the withdrawn one forced through a FlashConfig
(16 x 128, 8 warps, 1 stage, dQ transposed: mis-assembled by ptxas 12.8, expected to fault or be
wrong with Triton 3.6).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 140          # the whole probe, with some margin under 150 s
SANITIZER_S = 90        # compute-sanitizer's one run
WITHDRAWN = (16, 128, 8, 1, True)  # (BLOCK_Q, BLOCK_K, warps, stages, dQ transposed)

# name -> shape, dtype, mask, and tiles: None for what the ladder's autotuner picks, else forced
CASES = {
    "faulted-bf16-causal-4096": dict(batch=1, heads=4, seq=4096, dim=128, dtype="bfloat16", causal=True, tiles=None),
    "faulted-fp16-8192": dict(batch=1, heads=4, seq=8192, dim=128, dtype="float16", causal=False, tiles=None),
    "d64-bf16-causal-4096": dict(batch=1, heads=4, seq=4096, dim=64, dtype="bfloat16", causal=True, tiles=None),
    "ragged-bf16-causal-1000": dict(batch=2, heads=3, seq=1000, dim=128, dtype="bfloat16", causal=True, tiles=None),
    "transposed-16x64": dict(batch=1, heads=4, seq=4096, dim=128, dtype="bfloat16", causal=True,
                             tiles=(16, 64, 4, 3, True)),
    "withdrawn-16x128-1-stage": dict(batch=1, heads=4, seq=4096, dim=128, dtype="bfloat16", causal=True,
                                     tiles=WITHDRAWN),
}
SANITIZED = "withdrawn-16x128-1-stage"
# the probe's own plumbing, without a GPU: a stand-in for each kind of outcome, and what the parent must call it
SELF_TEST = {"selftest-ok": "ok", "selftest-wrong": "wrong", "selftest-fault": "fault", "selftest-crash": "fault",
             "selftest-hang": "timeout"}
FAULT_MARKERS = ("illegal memory access", "illegal address", "misaligned address", "unspecified launch failure",
                 "cudaErrorIllegalAddress", "Out-of-range shared or local address")


def is_fault(text: str) -> bool:
    return any(marker in text for marker in FAULT_MARKERS)


# ----- one case, in its own process ------------------------------------------------------------

def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _config(tiles):
    from flashlib.kernels import FlashConfig

    bm, bn, warps, stages, transposed = tiles
    return FlashConfig(bwd_block_q=bm, bwd_block_k=bn, bwd_num_warps=warps, bwd_num_stages=stages,
                       bwd_dq_transposed=transposed)


def run_case(case: dict, device: str = "cuda") -> dict:
    """The ladder's lean forward with the bulk backward against SDPA (on the GPU; a CPU runs the
    same code in Triton's interpreter, where the bulk reductions are per-element atomics)."""
    import torch
    import torch.nn.functional as F

    from flashlib.ladder import attention
    from flashlib.ladder.backward import autotuned_choices

    dtype, causal = getattr(torch, case["dtype"]), case["causal"]
    g = torch.Generator(device=device).manual_seed(0)
    shape = (case["batch"], case["heads"], case["seq"], case["dim"])
    q, k, v, dout = (torch.randn(shape, device=device, generator=g).to(dtype) for _ in range(4))
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
    want = _grads(sdpa, *(t.float() for t in (q, k, v, dout)))
    theirs = _grads(sdpa, q, k, v, dout)
    cfg = None if case["tiles"] is None else _config(case["tiles"])
    got = _grads(lambda a, b, c: attention(a, b, c, causal=causal, config=cfg, forward="lean", backward="bulk"),
                 q, k, v, dout)
    if device == "cuda":
        torch.cuda.synchronize()  # an illegal access surfaces here at the latest
    errors = {}
    for name, mine, reference, low in zip(("out", "dq", "dk", "dv"), got, want, theirs):
        err, bound = _max_err(mine, reference), 2 * _max_err(low, reference) + 1e-4
        errors[name] = dict(error=err, bound=bound, finite=bool(torch.isfinite(mine).all()))
    right = all(e["finite"] and e["error"] <= e["bound"] for e in errors.values())
    # what ran: the autotuner's choice ({"fused": BLOCK_Q, BLOCK_K, [DQ_T,] warps, stages}) or the forced tiles
    tiles = autotuned_choices(case["dim"], dtype, causal, "bulk", case["seq"]) if cfg is None else case["tiles"]
    return dict(status="ok" if right else "wrong", errors=errors, tiles_run=tiles)


def run_self_test(name: str) -> dict:
    if name == "selftest-fault":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (a stand-in)")
    if name == "selftest-crash":
        os.abort()  # a process killed by a signal, as a driver may kill a faulting one
    if name == "selftest-hang":
        time.sleep(3600)
    return dict(status="ok" if name == "selftest-ok" else "wrong", errors={})


def child(name: str) -> int:
    """Run one case and print its result as one JSON line; 1 if it raised."""
    try:
        result = run_self_test(name) if name in SELF_TEST else run_case(CASES[name])
        code = 0
    except Exception as exc:  # the kind is the finding: a fault, or some other failure
        text = f"{type(exc).__name__}: {exc}"
        result, code = dict(status="fault" if is_fault(text) else "error", detail=text[-2000:]), 1
    print(json.dumps(result, default=str), flush=True)
    return code


# ----- the parent: every case at once, each in a process of its own --------------------------------

def _start(command: list, folder: Path, name: str):
    """A child in a session of its own (so that a timeout kills it and whatever it started), its
    output in files (a full pipe would stall it while the parent waits on another)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out, err = open(folder / f"{name}.out", "w+"), open(folder / f"{name}.err", "w+")
    proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)
    return dict(proc=proc, out=out, err=err, started=time.monotonic())


def _finish(job: dict, timed_out: bool) -> tuple[str, str, int]:
    if timed_out:
        os.killpg(job["proc"].pid, signal.SIGKILL)
    code = job["proc"].wait()
    texts = []
    for f in (job["out"], job["err"]):
        f.seek(0)
        texts.append(f.read())
        f.close()
    return texts[0], texts[1], code


def verdict(stdout: str, stderr: str, code: int, timed_out: bool) -> dict:
    """A case's result from what its process left: its JSON line, else how it ended."""
    if timed_out:
        return dict(status="timeout", detail=stderr[-1500:])
    for line in reversed(stdout.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and "status" in found:
            return dict(found, returncode=code)
    died = code < 0 or is_fault(stderr)  # killed by a signal, or the driver said why
    return dict(status="fault" if died else "error", returncode=code, detail=stderr[-1500:])


def _sanitizer_command():
    tool = shutil.which(os.environ.get("FLASHLIB_SANITIZER", "compute-sanitizer"))
    if tool is None:
        return None
    return [tool, "--tool", "memcheck", "--print-limit", "10", sys.executable, str(Path(__file__).resolve()),
            "--case", SANITIZED]


def _sanitized(stdout: str, stderr: str, code: int, timed_out: bool, seconds: float) -> dict:
    text = stdout + stderr
    return dict(ran=True, case=SANITIZED, seconds=round(seconds, 1), returncode=code, timed_out=timed_out,
                errors_reported=sum("Out-of-range" in line or "Invalid" in line for line in text.splitlines()),
                tail=text[-4000:])


def _header() -> dict:
    head = dict(probe="bulk backward", python=platform.python_version(), started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        import torch

        head.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            head.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)))
        from importlib.metadata import version

        head["triton"] = version("triton")
    except Exception as exc:  # the header is context, never a reason to stop
        head["header_error"] = f"{type(exc).__name__}: {exc}"
    return head


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def _case_entry(name: str) -> dict:
    case = CASES.get(name, {})
    expect = SELF_TEST.get(name) or ("fault or wrong" if case.get("tiles") == WITHDRAWN else "ok")
    return dict(name=name, **case, expect=expect)


def _as_expected(case: dict) -> bool:
    return case["status"] in case["expect"].split(" or ")


def probe(names, out_path: Path, budget_s: float = BUDGET_S, sanitize: bool = True) -> dict:
    """Run the named cases at once, each in its own process, and the sanitizer's run beside them;
    every process still running at the deadline is killed and reported as "timeout"."""
    start = time.monotonic()
    deadline = start + budget_s
    folder = Path(tempfile.mkdtemp(prefix="bulk-probe-logs-"))
    jobs = {name: _start([sys.executable, str(Path(__file__).resolve()), "--case", name], folder, name)
            for name in names}
    command = _sanitizer_command() if sanitize else None
    if command is not None:
        jobs["sanitizer"] = _start(command, folder, "sanitizer")
    report = dict(_header(), budget_s=budget_s, cases=[], sanitizer=dict(ran=False, why="not asked for"))
    if sanitize and command is None:
        report["sanitizer"] = dict(ran=False, why="compute-sanitizer is not on PATH")
    limits = {name: deadline for name in jobs}
    if "sanitizer" in jobs:
        limits["sanitizer"] = min(deadline, start + SANITIZER_S)
    while jobs:
        now = time.monotonic()
        for name, job in list(jobs.items()):
            running = job["proc"].poll() is None
            if running and now < limits[name]:
                continue
            timed_out = running  # still running at its limit: killed
            stdout, stderr, code = _finish(jobs.pop(name), timed_out)
            seconds = time.monotonic() - job["started"]
            if name == "sanitizer":
                report["sanitizer"] = _sanitized(stdout, stderr, code, timed_out, seconds)
            else:
                report["cases"].append(dict(_case_entry(name), seconds=round(seconds, 1),
                                            **verdict(stdout, stderr, code, timed_out)))
            report["elapsed_s"] = round(time.monotonic() - start, 1)
            _write(out_path, report)
        time.sleep(0.2)
    report["as_expected"] = all(_as_expected(c) for c in report["cases"])
    ladder = [c for c in report["cases"] if c["name"] in CASES and c["expect"] == "ok"]
    report["ladder_ok"] = bool(ladder) and all(c["status"] == "ok" for c in ladder)
    _write(out_path, report)
    return report


def _out_path(given: str | None) -> Path:
    if given:
        return Path(given)
    folder = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bulk-probe-")
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / "bulk-probe.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", help="run this one case here and print its result (what each child does)")
    parser.add_argument("--cases", help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--self-test", action="store_true", help="stand-in cases that need no GPU")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole probe (default {BUDGET_S}; "
                        "5 with --self-test, whose hanging stand-in waits for it)")
    parser.add_argument("--no-sanitizer", action="store_true")
    parser.add_argument("--out", help="the JSON file (default $OUT/bulk-probe.json)")
    args = parser.parse_args(argv)
    if args.case:
        if args.case not in CASES and args.case not in SELF_TEST:
            parser.error(f"--case must be one of {tuple(CASES) + tuple(SELF_TEST)}, got {args.case!r}")
        return child(args.case)
    names = tuple(SELF_TEST) if args.self_test else (args.cases.split(",") if args.cases else tuple(CASES))
    unknown = [n for n in names if n not in CASES and n not in SELF_TEST]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {tuple(CASES)}")
    out = _out_path(args.out)
    budget = args.budget if args.budget is not None else (5 if args.self_test else BUDGET_S)
    report = probe(names, out, budget, sanitize=not args.no_sanitizer and not args.self_test)
    for case in report["cases"]:
        print(f"{case['name']:28s} {case['status']:8s} (expected {case['expect']}) {case['seconds']:6.1f} s")
    sanitizer = report["sanitizer"]
    print("sanitizer:", f"{sanitizer['errors_reported']} errors reported" if sanitizer["ran"] else sanitizer["why"])
    print(f"every case as expected: {report['as_expected']}; written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
