// A click on a figure (a link of class flashlib-zoom, docs/_ext/figure_zoom.py) shows it over the
// page as large as the window allows, up to MAX_SCALE times its own pixels; a click or Escape
// closes it. Ctrl/Cmd-click still opens the image file itself.
(() => {
  const MAX_SCALE = 2.5;  // the figures are 72 dpi: beyond this the pixels only blur

  function close() {
    const open = document.querySelector(".flashlib-zoom-view");
    if (open) open.remove();
  }

  function show(link) {
    const source = link.querySelector("img");
    const view = document.createElement("div");
    view.className = "flashlib-zoom-view";
    view.setAttribute("role", "dialog");
    view.setAttribute("aria-label", "enlarged figure: click or press Escape to close");
    const image = document.createElement("img");
    image.src = link.href;
    image.alt = source ? source.alt : "";
    const fit = () => {
      const natural = image.naturalWidth, tall = image.naturalHeight;
      if (!natural) return;
      const scale = Math.min(MAX_SCALE, 0.96 * window.innerWidth / natural, 0.94 * window.innerHeight / tall);
      image.style.width = `${Math.round(natural * scale)}px`;
    };
    image.addEventListener("load", fit);
    view.appendChild(image);
    view.addEventListener("click", close);
    document.body.appendChild(view);
    if (image.complete) fit();
  }

  document.addEventListener("click", (event) => {
    const link = event.target.closest && event.target.closest("a.flashlib-zoom");
    if (!link || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;
    event.preventDefault();
    show(link);
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") close(); });
})();
