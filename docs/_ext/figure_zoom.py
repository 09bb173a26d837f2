"""Every figure of the site links to its own image file, and a click shows it enlarged.

The notebooks' figures are drawn at 72 dpi with 6-8 pt labels (matplotlib's inline backend):
about 6-8 px in the content column, too small to read. Each image is wrapped in a link to its
file in _images/ (without JavaScript the browser opens the image alone, to zoom as it likes);
_static/figure_zoom.js turns the click into an enlarged view over the page.
"""
from __future__ import annotations

import posixpath
import urllib.parse

from docutils import nodes
from sphinx.util.osutil import relative_uri

ZOOM_CLASS = "flashlib-zoom"


def _link_images(app, doctree, docname):
    if app.builder.format != "html":
        return
    images_dir = relative_uri(app.builder.get_target_uri(docname), "_images")
    for image in list(doctree.findall(nodes.image)):
        if isinstance(image.parent, nodes.reference):
            continue  # an image that already links somewhere keeps its link
        uri = image["uri"]
        if uri not in app.env.images:
            continue  # a remote image: nothing of ours to enlarge
        link = nodes.reference("", "", internal=True, classes=[ZOOM_CLASS],
                               refuri=posixpath.join(images_dir, urllib.parse.quote(app.env.images[uri][1])))
        image.replace_self(link)
        link.append(image)


def setup(app):
    app.connect("doctree-resolved", _link_images)
    app.add_js_file("figure_zoom.js")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
