"""Interactive steppers for the notebooks, built on flashlib's traces and viz figures.

Each stepper is an ipywidgets box: sliders and toggles on top, the figure below as an
``ipywidgets.Image`` holding PNG bytes, so every slider move swaps the image. The
figures are the ones :mod:`flashlib.viz` draws for the static notebook outputs.
"""
from __future__ import annotations

import asyncio
import base64
import statistics
import time

import ipywidgets as widgets
import torch

from . import viz
from ..softmax import online_softmax_steps
from ..tiled import trace_tiled_attention


class FigureBox(widgets.VBox):
    """A box of controls over ``self.image`` (an ``ipywidgets.Image`` of PNG bytes).

    Frames are kept by state: a move back to a state drawn before only swaps bytes. In a
    kernel, once a move's picture is sent, the states one move away are drawn ahead while
    the kernel idles, one per turn of its event loop, so the next move finds its frame ready
    instead of waiting for matplotlib (50-150 ms a redraw, several times that on a busy
    laptop); the box carries the class ``flashlib-drawing-ahead`` until they are done.

    Its display carries the current picture as ``image/png`` beside the widget view, so a
    stored notebook read without a kernel (the course's site, GitHub, nbviewer) shows the
    frame the stepper opened on instead of an empty box. JupyterLab still shows the live
    widget: it prefers the widget view when a kernel holds the widget.

    Subclasses define ``_state()`` (the controls' values, hashable), ``_draw(state)`` (PNG
    bytes) and ``_neighbours(state)`` (states one move away, likeliest first).
    """

    MAX_FRAMES = 256  # about 50 KB each
    AHEAD_CLASS = "flashlib-drawing-ahead"

    def redraw(self):
        """Show the frame of the controls' current state; draw its neighbours ahead."""
        state = self._state()
        self.image.value = self._frame(state)
        self._ahead = iter(self._neighbours(state))  # lazily: a neighbour may cost a trace
        if not getattr(self, "_ahead_scheduled", False):
            try:
                loop = asyncio.get_running_loop()  # a kernel's; plain Python draws on demand only
            except RuntimeError:
                return
            self._ahead_scheduled = True
            self.add_class(self.AHEAD_CLASS)
            loop.call_later(0.001, self._draw_ahead, loop)

    def _draw_ahead(self, loop):
        """Draw the next neighbour not yet kept; come back on a later turn of the loop, after
        any message waiting (a move), until none is left."""
        state = next((s for s in self._ahead if s not in self._frames_kept()), None)
        if state is not None and self.comm is not None:
            self._frame(state)
            loop.call_later(0.001, self._draw_ahead, loop)
            return
        self._ahead_scheduled = False
        if self.comm is not None:
            self.remove_class(self.AHEAD_CLASS)

    def _frames_kept(self) -> dict:
        return self.__dict__.setdefault("_frames", {})

    def _frame(self, state) -> bytes:
        frames = self._frames_kept()
        if state not in frames:
            if len(frames) >= self.MAX_FRAMES:
                frames.pop(next(iter(frames)))  # the oldest
            frames[state] = self._draw(state)
        return frames[state]

    def _neighbours(self, state):
        return ()

    def _repr_mimebundle_(self, **kwargs):
        """ipywidgets 8's display of the widget, with the current frame as ``image/png`` beside it."""
        shown = getattr(super(), "_repr_mimebundle_", None)
        if shown is None:  # ipywidgets 7: the widget shows through _ipython_display_ (closed: as text)
            return None
        return self._with_frame(shown(**kwargs))

    if hasattr(widgets.Widget, "_ipython_display_"):  # ipywidgets 7 (Colab's 7.7.1) displays through this
        def _ipython_display_(self, **kwargs):
            """ipywidgets 7's display of the widget (its Widget._ipython_display_), with the current frame
            as ``image/png`` beside it, as :meth:`_repr_mimebundle_` gives it with ipywidgets 8."""
            from IPython.display import display

            text = repr(self)
            view = {"version_major": 2, "version_minor": 0, "model_id": self._model_id}
            display(self._with_frame({"text/plain": text[:110] + "…" if len(text) > 110 else text,
                                      "application/vnd.jupyter.widget-view+json": view}), raw=True)
            self._handle_displayed(**kwargs)

    def _with_frame(self, bundle):
        frame = getattr(self, "image", None)
        if bundle is not None and frame is not None and frame.value:
            bundle["image/png"] = base64.b64encode(bytes(frame.value)).decode("ascii")
        return bundle


class TileStepper(FigureBox):
    """Replay tiled attention tile by tile (notebook 03).

    Sliders: ``block_q`` (query rows per block, BLOCK_Q), ``block_k`` (keys per tile,
    BLOCK_K) and ``step``; toggles: the loop order ("query" or "key") and causal masking.
    q, k, v: (batch, heads, seq, head_dim) or (seq, head_dim); the first batch/head is shown.
    """

    def __init__(self, q, k, v, *, block_q: int = 2, block_k: int = 2, causal: bool = False,
                 loop: str = "query", step: int = 0, scale=None):
        self._inputs = (q, k, v, scale)
        self._traces = {}
        # one view per kind of move: a step repaints over its view's cached background,
        # which drawing another schedule ahead would throw away
        self.view, self._ahead_view = viz.TileStepView(), viz.TileStepView()
        self.trace, self.ylim = self._trace(block_q, block_k, causal, loop)
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        self.block_q = widgets.IntSlider(value=block_q, min=1, max=seq_q, description="block_q",
                                         continuous_update=False)
        self.block_k = widgets.IntSlider(value=block_k, min=1, max=seq_k, description="block_k",
                                         continuous_update=False)
        self.step = widgets.IntSlider(value=step, min=0, max=len(self.trace.steps) - 1,
                                      description="step")
        self.loop = widgets.ToggleButtons(options=["query", "key"], value=loop, description="loop")
        self.causal = widgets.ToggleButton(value=causal, description="causal")
        self.image = widgets.Image(format="png")
        self.image.add_class("flashlib-figure")
        controls = widgets.HBox([widgets.VBox([self.block_q, self.block_k, self.step]),
                                 widgets.VBox([self.loop, self.causal])])
        super().__init__([controls, self.image])
        self.add_class("flashlib-tile-stepper")
        for control in (self.block_q, self.block_k, self.loop, self.causal):
            control.observe(self._on_schedule, names="value")
        self.step.observe(self._on_step, names="value")
        self.redraw()

    def _trace(self, block_q, block_k, causal, loop):
        """(trace, its panels' y ranges) of one schedule, computed once."""
        schedule = (block_q, block_k, causal, loop)
        if schedule not in self._traces:
            q, k, v, scale = self._inputs
            trace = trace_tiled_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal,
                                          scale=scale, loop=loop)
            self._traces[schedule] = trace, viz.trace_limits(trace)
        return self._traces[schedule]

    def _on_schedule(self, _change):
        self.trace, self.ylim = self._trace(self.block_q.value, self.block_k.value,
                                            self.causal.value, self.loop.value)
        last = len(self.trace.steps) - 1
        with self.step.hold_trait_notifications():
            self.step.value = min(self.step.value, last)
            self.step.max = last
        self.redraw()

    def _on_step(self, _change):
        self.redraw()

    def _state(self):
        return (self.block_q.value, self.block_k.value, self.causal.value, self.loop.value,
                self.step.value)

    def _draw(self, state):
        *schedule, step = state
        trace, ylim = self._trace(*schedule)
        view = self.view if trace is self.trace else self._ahead_view
        view.draw(trace, step, ylim)
        return view.png()

    def _neighbours(self, state):
        """The next and previous step, then each schedule control moved once, at the step the
        stepper would keep."""
        block_q, block_k, causal, loop, step = state
        last = len(self.trace.steps) - 1
        yield from ((*state[:4], s) for s in (step + 1, step - 1) if 0 <= s <= last)
        seq_q, seq_k = self._inputs[0].shape[-2], self._inputs[1].shape[-2]
        schedules = [(b, block_k, causal, loop) for b in (block_q + 1, block_q - 1) if 1 <= b <= seq_q]
        schedules += [(block_q, b, causal, loop) for b in (block_k + 1, block_k - 1) if 1 <= b <= seq_k]
        schedules += [(block_q, block_k, not causal, loop),
                      (block_q, block_k, causal, "key" if loop == "query" else "query")]
        for schedule in schedules:
            yield (*schedule, min(step, len(self._trace(*schedule)[0].steps) - 1))

    def figure(self):
        """The current step as a regular matplotlib figure (shows without a kernel)."""
        return viz.tile_step_figure(self.trace, self.step.value, self.ylim)

    def __repr__(self):
        # Stored notebooks compare this text: keep it free of widget ids and image bytes.
        return (f"TileStepper(block_q={self.block_q.value}, block_k={self.block_k.value}, "
                f"step={self.step.value} of 0..{self.step.max}, loop={self.loop.value!r}, "
                f"causal={self.causal.value})")


class OnlineSoftmaxStepper(FigureBox):
    """Step through online softmax over one row ``x`` (notebook 02), ``block`` elements at a time."""

    def __init__(self, x, *, block: int = 1, step: int = 1):
        self.x = torch.as_tensor(x).reshape(-1)
        self.steps = online_softmax_steps(self.x, block=block)
        self.step = widgets.IntSlider(value=step, min=1, max=len(self.steps) - 1, description="step")
        self.image = widgets.Image(format="png")
        self.image.add_class("flashlib-figure")
        super().__init__([self.step, self.image])
        self.add_class("flashlib-softmax-stepper")
        self.step.observe(lambda _change: self.redraw(), names="value")
        self.redraw()

    def _state(self):
        return self.step.value

    def _draw(self, step):
        return viz.figure_png(viz.online_softmax_figure(self.x, self.steps, step))

    def _neighbours(self, step):
        return [s for s in (step + 1, step - 1, step + 2, step - 2) if 1 <= s <= self.step.max]

    def figure(self):
        """The current step as a regular matplotlib figure."""
        return viz.online_softmax_figure(self.x, self.steps, self.step.value)

    def __repr__(self):
        return f"OnlineSoftmaxStepper(n={self.x.numel()}, step={self.step.value} of 1..{self.step.max})"


def _median_redraw_ms(stepper: TileStepper, moves: int) -> float:
    last = stepper.step.max
    times = []
    for i in range(moves):
        target = (i + 1) % (last + 1)  # walk the slider through every step, wrapping round
        start = time.perf_counter()
        stepper.step.value = target
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


def benchmark_redraw(moves: int = 40, verbose: bool = True) -> dict[str, float]:
    """Median time (ms) for one step-slider move to redraw the figure, in this kernel.

    Two cases: the course's 6x4 example with 2x2 tiles, and N = 64, head_dim 16 with
    8x8 causal tiles. Times the Python side (trace lookup, drawing, PNG encoding), not
    the browser's paint.
    """
    generator = torch.Generator().manual_seed(0)
    small = [torch.randn(1, 6, 4, generator=generator) for _ in range(3)]
    large = [torch.randn(1, 64, 16, generator=generator) for _ in range(3)]
    cases = {
        "6x4, 2x2 tiles": TileStepper(*small, block_q=2, block_k=2),
        "N=64, d=16, 8x8 causal tiles": TileStepper(*large, block_q=8, block_k=8, causal=True),
    }
    results = {}
    for name, stepper in cases.items():
        results[name] = _median_redraw_ms(stepper, moves)
        stepper.close()
        if verbose:
            print(f"{name}: median redraw {results[name]:.1f} ms over {moves} slider moves")
    return results
