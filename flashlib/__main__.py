"""Command line: ``python -m flashlib {demo, bench cpu, bench cascade, bench calls, bench widgets, gpu-check, labs grade,
labs autograder}``."""
from __future__ import annotations

import argparse
import json
import sys


def _labs_parsers(sub) -> None:
    """``labs grade`` and ``labs autograder``."""
    labs = sub.add_parser("labs", help="the labs: grade saved notebooks, or build an autograder that does")
    labs_sub = labs.add_subparsers(dest="labs_command", required=True)
    grade = labs_sub.add_parser("grade", help="run every lab and checked exercise cell of the notebooks, each in a "
                                              "sandboxed process of its own, and write the gradebook")
    grade.add_argument("notebooks", nargs="+", metavar="PATH",
                       help="saved notebooks (.ipynb), a student's folder of them, or a class's folder of student "
                            "folders")
    grade.add_argument("--out", metavar="DIR", help="write every file below into DIR: grades.csv (wide), rows.csv, "
                                                    "grades.json and feedback/")
    grade.add_argument("--csv", metavar="FILE", help="the long CSV: one row per student and item, written as cells "
                                                     "finish, with the checker's whole message")
    grade.add_argument("--json", metavar="FILE", help="the same as JSON, with the items, their points and each "
                                                      "student's total")
    grade.add_argument("--wide", metavar="FILE", help="the gradebook a learning platform takes: one row per student "
                                                      "(id, one column per item, total, possible, percent)")
    grade.add_argument("--feedback", metavar="DIR", help="a Markdown file per student with every item's message")
    grade.add_argument("--roster", metavar="FILE", help="student ids, one a line (or a CSV's id column): a student "
                                                        "with no folder gets 0")
    grade.add_argument("--assignment", nargs="+", metavar="NOTEBOOK",
                       help="the course's notebooks the assignment is (default: those handed in)")
    grade.add_argument("--jobs", type=int, default=1, help="cells graded at once (default 1)")
    grade.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    grade.add_argument("--memory", type=int, default=4096, metavar="MIB",
                       help="memory a cell's processes may hold together, in MiB (default 4096)")
    autograder = labs_sub.add_parser("autograder", help="build an otter-grader autograder for Gradescope (otter run, "
                                                        "otter grade): one hidden test per lab and checked exercise, "
                                                        "judged by this grader")
    autograder.add_argument("out", metavar="OUT.zip", help="the autograder's zip, to upload to Gradescope")
    autograder.add_argument("--notebooks", metavar="02,03", help="the course notebooks it grades, by number or name "
                                                                 "(default: all; Gradescope takes one notebook per "
                                                                 "submission, so one per assignment)")
    autograder.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    autograder.add_argument("--memory", type=int, default=4096, metavar="MIB",
                            help="memory a cell's processes may hold together, in MiB (default 4096)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="replay the six-token, 2x2-tile example and run its three checks")
    bench = sub.add_parser("bench", help="measure and record benchmarks under data/bench/")
    bench.add_argument("target", choices=["cpu", "cascade", "calls", "widgets"])
    bench.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (cpu; default 1k to 16k)")
    bench.add_argument("--out-dir", help="where to write the JSON (default data/bench/)")
    sub.add_parser("gpu-check", help="GPU tests, the notebooks and the ladder benchmark (CUDA machine only)",
                   add_help=False)
    _labs_parsers(sub)
    args, rest = parser.parse_known_args(argv)

    if args.command == "demo":
        from .demo import run
        return 0 if run() else 1
    if args.command == "bench" and args.target == "cpu":
        from .bench.cpu import CPU_SIZES, format_ratios, run_cpu_bench
        print("dense vs tiled attention on this CPU (B = H = 1, d = 64, float32), one process per point")
        path = run_cpu_bench(sizes=args.sizes or CPU_SIZES, out_dir=args.out_dir, log=print)
        print(format_ratios(json.loads(path.read_text())["ratios"]))
        print(f"wrote {path}")
        return 0
    if args.command == "bench" and args.target == "cascade":
        from .bench.cascade import SHAPE, run_cascade_bench
        print(f"shared-prefix decoding against plain decoding on this CPU (PyTorch, float32, {SHAPE})")
        print(f"wrote {run_cascade_bench(out_dir=args.out_dir, log=print)}")
        return 0
    if args.command == "bench" and args.target == "calls":
        from .bench.calls import run_calls_bench
        print("the host's microseconds per call: compiled score and mask functions kept, and made every call")
        print(f"wrote {run_calls_bench(out_dir=args.out_dir, log=print)}")
        return 0
    if args.command == "bench" and args.target == "widgets":
        from .course.widgets import benchmark_redraw
        benchmark_redraw()
        return 0
    if args.command == "labs" and args.labs_command == "autograder":
        from .labs.autograder import main as autograder_main
        return autograder_main(args.out, args.notebooks, args.timeout, args.memory)
    if args.command == "labs":
        from .labs.grade import main as grade_main
        return grade_main(args.notebooks, args.json, args.timeout, csv_path=args.csv, jobs=args.jobs,
                          memory_mib=args.memory, wide_path=args.wide, feedback_dir=args.feedback, out_dir=args.out,
                          roster_path=args.roster, names=args.assignment)
    if args.command == "gpu-check":
        from .bench.check import main as gpu_main
        return gpu_main(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
