// Long lines of code and printed output wrap at the column's edge (course.css); here each line
// becomes a block of its own with a hanging indent, so that the rest of a wrapped line sits to the
// right of where the line began and is never read as a line of its own (a dedent, in Python).
(() => {
  const HANG = 4;  // characters of extra indent for the rest of a wrapped line

  function lineBlock(indent) {
    const line = document.createElement("span");
    line.className = "flashlib-line";
    line.style.paddingLeft = `${indent + HANG}ch`;
    line.style.textIndent = `-${indent + HANG}ch`;
    return line;
  }

  function wrap(pre) {
    // the highlighter's spans are flat: (text, class) pieces, split again at each newline
    const pieces = Array.from(pre.childNodes).map(node => [node.textContent, node.nodeType === 1 ? node.className : null]);
    const lines = [[]];
    for (const [text, cls] of pieces) {
      text.split("\n").forEach((part, i) => {
        if (i > 0) lines.push([]);
        if (part) lines[lines.length - 1].push([part, cls]);
      });
    }
    if (lines.length > 1 && !lines[lines.length - 1].length) lines.pop();  // the final newline
    pre.replaceChildren(...lines.map(parts => {
      const text = parts.map(([t]) => t).join("");
      const line = lineBlock(text.length - text.trimStart().length);
      for (const [part, cls] of parts) {
        if (cls === null) { line.append(part); continue; }
        const span = document.createElement("span");
        span.className = cls;
        span.textContent = part;
        line.append(span);
      }
      line.append("\n");  // copied text keeps its line breaks
      return line;
    }));
    pre.classList.add("flashlib-wrapped");
  }

  function wrapAll() { document.querySelectorAll(".bd-article pre").forEach(wrap); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", wrapAll);
  else wrapAll();
})();
