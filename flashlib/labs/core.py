"""check, hint and solution: what a notebook calls.

``check(name, fn)`` runs the lab's checker and prints its verdict (a pass is also written to the
progress file beside the notebooks, :mod:`.progress_file`); ``hint(name)`` prints the next of three
hints, only when asked; ``solution(name)`` prints a worked solution, whose text
``solution_source(name)`` returns; ``reveal(name)`` prints the course's own code of the lab once
it has passed (or its solution was shown) in this session. The student edition of the course
(``make student``) ships no worked solutions: there ``solution`` and ``reveal`` say so. Unknown
names raise a ValueError that lists the labs.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from importlib import resources

from .. import edition
from ..course import verdicts
from ..course.exercises import PASS, RETRY
from .catalog import LABS, MISTAKES, Lab
from . import own_code, progress_file
from .common import Report
from ..course.remote import beside_answer


@dataclass(frozen=True)
class LabResult:
    """A checker's verdict: ``bool(result)`` is ``result.passed``; ``message`` is what was printed.

    ``mistake`` is the key (in :data:`flashlib.labs.MISTAKES`) of the known mistake recognised,
    ``case`` the 1-based number of the first case that failed.
    """

    name: str
    passed: bool
    message: str
    mistake: str | None = None
    case: int | None = None

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"LabResult({self.name!r}, passed={self.passed}, mistake={self.mistake!r})"


def lab(name, fn: str = "labs.check") -> Lab:
    """The lab called ``name``, or a ValueError naming it and the labs there are."""
    if not isinstance(name, str) or name not in LABS:
        raise ValueError(f"{fn}: argument 'name' is {name!r}, which is not a lab; the labs are "
                         f"{', '.join(LABS)}")
    return LABS[name]


# name -> (module, function) of its checker; the kernel labs' module imports Triton, so each is imported on use
_CHECKERS = {"online_softmax": ("softmax_labs", "check_online_softmax"),
             "merge_states": ("softmax_labs", "check_merge_states"),
             "tiled_forward": ("tiled_labs", "check_tiled_forward"),
             "tiled_backward": ("tiled_labs", "check_tiled_backward"),
             "attn_fwd_inner": ("kernel_labs", "check_attn_fwd_inner"),
             "attn_bwd_dkdv_inner": ("kernel_labs", "check_attn_bwd_dkdv_inner"),
             "split_kv": ("split_kv_lab", "check_split_kv"),
             "sink_grad": ("sink_lab", "check_sink_grad")}


def _checker(name: str):
    module, function = _CHECKERS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def has_solutions() -> bool:
    """Whether this edition of the course ships the worked solutions (the student edition does not)."""
    return edition.solutions_shipped()


def _no_solutions(name: str) -> str:
    count = len(edition.given(lab(name).hints))
    return (f"{edition.NO_SOLUTIONS} and no course code to reveal. "
            f'labs.hint("{name}") gives the next hint ({count}, one at a time); labs.check("{name}", {name}) '
            "says what is wrong.")


_ORDER = ("Triton was imported before flashlib could switch on its CPU interpreter, so no kernel can run in "
          "this Python process. Restart the kernel (Kernel > Restart) and run this lab's cell first: it imports "
          "flashlib before triton.")


def _run_checker(name: str, fn) -> Report | str:
    """The checker's report, or why no checker can run here (Triton missing, or imported too early)."""
    try:
        checker = _checker(name)
    except ImportError as error:
        return str(error)
    except RuntimeError as error:
        if "imported before its CPU interpreter" not in str(error):
            raise
        return _ORDER
    return checker(fn)


def is_stub(fn) -> bool:
    """Whether ``fn``'s body is only a docstring and ``...`` or ``pass``: nothing written yet."""
    try:
        source = textwrap.dedent(inspect.getsource(getattr(fn, "fn", fn)))
        node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    except (OSError, TypeError, SyntaxError, StopIteration):
        return False
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
               and s.value.value is Ellipsis for s in body)


def _message(spec: Lab, report: Report, solutions: bool) -> str:
    if report.problem is None:
        return f"{PASS}: {spec.name} is right in all {report.cases} cases, which between them try " \
               f"{', '.join(spec.tries)}."
    problem = report.problem
    lines = [f"{RETRY}: {spec.name}, case {report.failed} of {report.cases} ({report.case}): {problem.what}"]
    if problem.mistake is not None:
        title, why = MISTAKES[problem.mistake]
        lines.append(f"  mistake: {title} — {problem.why or why}")
    more = f'; labs.solution("{spec.name}") a worked solution' if solutions else ""
    lines.append(f'  labs.hint("{spec.name}") gives a hint{more}.')
    return "\n".join(lines)


@beside_answer
def answer_facts(fn, name: str) -> dict:
    """What the checker needs to know of an answer before running it, found where the answer is: whether it
    is a stub, callable, its type and repr, and how it is the course's own code (None if not)."""
    facts = dict(stub=fn is None or fn is Ellipsis or is_stub(fn), callable=callable(fn), type=type(fn).__name__,
                 text=f"{fn!r:.60}", borrowed=None)
    if facts["callable"] and not facts["stub"]:
        facts["borrowed"] = own_code.used(fn, own_code.course_functions(lab(name).answers))
    return facts


def _refused(name: str, what: str, mistake: str) -> LabResult:
    if mistake == "library_attention":
        why = "This lab asks for the loop written out, tile by tile; a fused attention is what it teaches you to write."
    else:
        why = ("The lab asks you to write this step yourself; the course's version is what you are checked against, "
               "not an answer.")
    return LabResult(name, False, f"{RETRY}: {name}: {what}. {why} labs.hint(\"{name}\") gives a hint.", mistake)


def verdict(name: str, fn, *, solutions: bool | None = None) -> LabResult:
    """Lab ``name``'s verdict on the learner's ``fn``, printing nothing and keeping nothing: what :func:`check`
    prints, and what the grader records (``fn`` may be held in the student's process,
    :mod:`flashlib.course.remote`). ``solutions``: whether the message may point at a worked solution
    (default: whether this edition has them; the grader's students have the student edition)."""
    spec = lab(name)
    with own_code.checking(name):
        try:
            return _verdict(spec, fn, has_solutions() if solutions is None else solutions)
        except own_code.Refused as refused:
            return _refused(name, refused.text, refused.mistake)


def _verdict(spec: Lab, fn, solutions: bool) -> LabResult:
    name = spec.name
    facts = answer_facts(fn, name)
    if facts["stub"]:
        return LabResult(name, False, f"{RETRY}: no answer yet; expected a function {spec.signature}.")
    if not facts["callable"]:
        return LabResult(name, False, f"{RETRY}: expected a function {spec.signature}; got "
                                      f"{facts['type']} {facts['text']}.")
    if facts["borrowed"] is not None:
        return _refused(name, facts["borrowed"], "course_code")
    report = _run_checker(name, fn)
    if isinstance(report, str):
        return LabResult(name, False, f"{RETRY}: {report}")
    return LabResult(name, report.problem is None, _message(spec, report, solutions),
                     None if report.problem is None else report.problem.mistake, report.failed)


def check(name: str, fn) -> LabResult:
    """Run the learner's ``fn`` over lab ``name``'s cases; print and return the verdict."""
    result = verdict(name, fn)
    if result.passed:
        _SEEN.add(name)
        progress_file.record(name)
    print(result.message)
    verdicts.report(result.passed, result.message, lab=name, mistake=result.mistake)
    return result


_SEEN: set[str] = set()  # labs passed, or whose solution was shown, in this session


_HINTS_GIVEN: dict[str, int] = {}


def hint(name: str) -> None:
    """Print the next hint of lab ``name`` (three levels; the student edition may give fewer), then say
    there are no more."""
    spec = lab(name, "labs.hint")
    hints = edition.given(spec.hints)  # the student edition may stop before the last, which is near code
    level = _HINTS_GIVEN.get(name, 0) + 1
    if level > len(hints):
        more = f': labs.solution("{name}") shows a worked solution' if has_solutions() else \
            " in this edition: labs.check says what is wrong"
        print(f"No more hints for {name}{more}.")
        return
    _HINTS_GIVEN[name] = level
    print(f"hint {level} of {len(hints)} for {name}: {hints[level - 1]}")


def reset_hints(name: str | None = None) -> None:
    """Start the hints of lab ``name`` (of every lab when None) again from the first."""
    if name is None:
        _HINTS_GIVEN.clear()
    else:
        _HINTS_GIVEN.pop(lab(name, "labs.reset_hints").name, None)


def solution_source(name: str) -> str:
    """The source of lab ``name``'s worked solution: its imports and the function, ready for a cell."""
    spec = lab(name, "labs.solution_source")
    if not has_solutions():
        raise RuntimeError(_no_solutions(name))
    return resources.files("flashlib.labs.solutions").joinpath(f"{spec.name}.py").read_text(encoding="utf-8")


def solution(name: str) -> None:
    """Print lab ``name``'s worked solution (in the student edition, that there is none)."""
    lab(name, "labs.solution")
    if not has_solutions():
        print(_no_solutions(name))
        return
    print(solution_source(name).rstrip())
    _SEEN.add(name)


def reveal_source(name: str) -> str:
    """The source of the course's own code that lab ``name`` rewrites (its ``reveal`` functions), one after
    another."""
    spec = lab(name, "labs.reveal_source")
    if not has_solutions():
        raise RuntimeError(_no_solutions(name))
    sources = []
    for where in spec.reveal:
        module, function = where.split(":")
        fn = getattr(importlib.import_module(module), function)
        sources.append(inspect.getsource(getattr(fn, "fn", fn)).rstrip())  # a @triton.jit function keeps .fn
    return "\n\n".join(sources)


def reveal(name: str) -> None:
    """Print the course's own code of lab ``name`` once the lab has passed (or its solution was shown) here;
    before that, say so."""
    spec = lab(name, "labs.reveal")
    if not has_solutions():
        print(_no_solutions(name))
    elif not spec.reveal:
        print(f'{name} has no course code to show beyond labs.solution("{name}").')
    elif name not in _SEEN:
        names = " and ".join(w.split(":")[1] for w in spec.reveal)
        verb = "is" if len(spec.reveal) == 1 else "are"
        print(f"The course's {names} {verb} printed here once {name} passes labs.check (or after "
              f'labs.solution("{name}")): run this cell again then.')
    else:
        print(reveal_source(name))

