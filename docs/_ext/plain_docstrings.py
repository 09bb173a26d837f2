"""Read flashlib's docstrings as the plain text they are written in, with RST's roles and
``literals``: docutils would read an indented line right under a paragraph as an error and
``|a - b|`` as a substitution, so a blank line goes where the indentation changes, and bars
and stray asterisks outside literals are escaped.
"""
from __future__ import annotations

import re

# literals and roles, left as they are: ``code``, :role:`target`, `text`_
_LITERAL = re.compile(r"(``.+?``|:[a-z:]+:`[^`]+`|`[^`]+`_?)")
# *emphasis* and **strong** as written on purpose; any other asterisk is text (*args, B*H)
_EMPHASIS = re.compile(r"(\*\*?)(?=[^*\s])[^*]*?[^*\s]\1(?!\w)")
# a name ending in an underscore, which docutils would read as a link to a target
_TRAILING_UNDERSCORE = re.compile(r"(?<=\w)_(?!\w)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _escape_plain(text: str) -> str:
    pieces, end = [], 0
    for match in _EMPHASIS.finditer(text):
        pieces += [text[end:match.start()].replace("*", r"\*"), match.group(0)]
        end = match.end()
    pieces.append(text[end:].replace("*", r"\*"))
    return _TRAILING_UNDERSCORE.sub(r"\_", "".join(pieces).replace("|", r"\|"))


def _escape(text: str) -> str:
    parts = _LITERAL.split(text)
    for i in range(0, len(parts), 2):  # the even parts lie outside literals
        parts[i] = _escape_plain(parts[i])
    return "".join(parts)


def rst_safe(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_literal_block = False
    for line in lines:
        previous = out[-1] if out else ""
        if line.strip() and previous.strip() and _indent(line) != _indent(previous):
            out.append("")
        if in_literal_block and line.strip() and _indent(line) == 0:
            in_literal_block = False
        out.append(line if in_literal_block else _escape(line))
        if line.rstrip().endswith("::"):
            in_literal_block = True
    return out


def _process(app, what, name, obj, options, lines):
    lines[:] = rst_safe(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
