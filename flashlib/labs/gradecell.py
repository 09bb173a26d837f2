"""One graded cell, run by the grader in a process of its own: ``python -m flashlib.labs.gradecell JOB``.

JOB is a JSON file the grader wrote: the lab or exercise graded, the imports of the notebook's
earlier cells, the cell's source, the flashlib to use and where to write the result. This process
runs in an empty folder (the grader's copy of the notebook only), imports flashlib from where the
grader's own comes from (never from beside the submission), listens for the checkers' verdicts
(:mod:`flashlib.course.verdicts`) and only then runs the student's code. The result: the verdicts the
checkers reported, what the cell raised, and the flashlib that was imported.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def _magic_free(source: str) -> str:
    """A cell's code without IPython's % and ! lines (a plain interpreter runs it)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def main(job_path: str) -> int:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    result_file = open(job["result"], "w", encoding="utf-8")  # opened before any student code runs
    sys.argv = [sys.argv[0]]  # the student's code need not know where the result goes
    # the course's package first; the working folder (the copy's, not the submission's) after it
    sys.path = [job["package_root"]] + [p for p in sys.path if p not in ("", os.getcwd())]
    import flashlib
    from flashlib.course import verdicts
    from flashlib.labs import cells

    heard = []
    verdicts.listen(heard.append)
    raised, printed = None, io.StringIO()
    namespace = {"__name__": "__main__", "display": print}  # display() is IPython's; a lab cell may call it
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            if job["imports"]:
                exec(compile(_magic_free(job["imports"]), "<earlier imports>", "exec"), namespace)
            cells.run_source(_magic_free(job["source"]), job["name"], namespace)
    except BaseException as error:  # noqa: BLE001  whatever the cell raised is its verdict
        lines = str(error).strip().splitlines()
        raised = f"{type(error).__name__}: {lines[0] if lines else ''}"
        printed.write(traceback.format_exc(limit=-3))
    json.dump(dict(verdicts=heard, raised=raised, flashlib=os.path.abspath(flashlib.__file__),
                   printed=printed.getvalue()[-2000:]), result_file)
    result_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
