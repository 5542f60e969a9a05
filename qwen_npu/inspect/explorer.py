"""An ipywidgets explorer that drives a Session step by step and shows its state.

    ┌ prompt [..............] max new [8] [add request]                                   ┐
    │ [prefill] [decode step] [step] [sample] [x] sample after prefill/decode  [refresh]  │
    │                                          (a progress bar here while an action runs) │
    │ message: what the last button did, or the session's error                           │
    │ session: model, cache bar, block-occupancy grid, requests table                     │
    │ step history slider ──> that step's rows, block tables and slots                    │
    │ top-k next tokens of the last step │ slot [n] ──> owner, position, writes, K/V norms │
    └─────────────────────────────────────────────────────────────────────────────────────┘

It drives the same Session object the notebook holds: run code cells in between, then press
"refresh" (every button refreshes too). Errors from the session are shown, never raised. The
rows wrap to the notebook's width; the drawn views sit on white paper (see ``explorer_html``).
"""
from __future__ import annotations

import re

from . import html as h
from .explorer_html import STYLE, message_html, paper, progress_html
from .slot_detail import inspect_slot
from .snapshot import take_session, take_step
from .topk import topk

_IDS = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*,?\s*$")


def parse_prompt(text: str):
    """Comma-separated integers -> token ids; anything else -> the text itself."""
    if _IDS.match(text):
        return [int(x) for x in text.split(",") if x.strip()]
    return text


class Explorer:
    """The widgets; ``explore(sess)`` builds one. ``widget`` is the root box."""

    def __init__(self, sess, *, k: int = 5, max_new_tokens: int = 8):
        import ipywidgets as w
        self.session = sess
        self.k = k
        wrap = {"flex_flow": "row wrap", "align_items": "center"}
        # continuous_update=False: the text is sent once, when the box loses focus (pressing "add
        # request" does that), ahead of the click; per-keystroke updates are throttled by the front
        # end and the click could overtake the last of them.
        self.prompt = w.Text(placeholder="prompt text, or comma-separated token ids", description="prompt",
                             continuous_update=False,
                             layout=w.Layout(flex="1 1 320px", min_width="240px", max_width="560px"))
        self.max_new_tokens = w.BoundedIntText(value=max_new_tokens, min=1, max=sess.config.max_model_len,
                                               description="max new", layout=w.Layout(width="160px"))
        fit = {"width": "auto", "min_width": "72px"}
        self.add_button = w.Button(description="add request", button_style="primary", layout=w.Layout(**fit))
        self.prefill_button = w.Button(description="prefill", layout=w.Layout(**fit))
        self.decode_button = w.Button(description="decode step", layout=w.Layout(**fit))
        self.step_button = w.Button(description="step", tooltip="schedule + run + sample one step",
                                    layout=w.Layout(**fit))
        self.sample_button = w.Button(description="sample", layout=w.Layout(**fit))
        self.refresh_button = w.Button(description="refresh", layout=w.Layout(**fit))
        self.auto_sample = w.Checkbox(value=True, description="sample after prefill/decode", indent=False,
                                      layout=w.Layout(width="auto"))
        self.busy = w.HTML(layout=w.Layout(width="auto"))     # the progress indicator of a running action
        self.message = w.HTML()
        self.session_view = w.HTML()
        self.history = w.IntSlider(value=0, min=0, max=0, description="step", continuous_update=False)
        self.step_view = w.HTML()
        self.topk_view = w.HTML(layout=w.Layout(flex="1 1 360px", min_width="0", max_height="480px",
                                                overflow="auto"))     # k lines per row of a big batch
        num_slots = sess.config.num_blocks * sess.config.block_size
        self.slot = w.BoundedIntText(value=0, min=0, max=num_slots - 1, description="slot",
                                     layout=w.Layout(width="160px"))
        self.slot_view = w.HTML()
        self._topk_of = None                  # the step whose top-k is shown
        self._controls = [self.prompt, self.max_new_tokens, self.add_button, self.prefill_button,
                          self.decode_button, self.step_button, self.sample_button, self.refresh_button,
                          self.auto_sample, self.history, self.slot]
        self.add_button.on_click(lambda _: self._run("add request", self.add_request))
        self.prefill_button.on_click(lambda _: self._run("prefill", self._act, "prefill", sess.prefill))
        self.decode_button.on_click(lambda _: self._run("decode step", self._act, "decode step",
                                                        sess.decode_step))
        self.step_button.on_click(lambda _: self._run("step", self._act, "step", sess.step, sample=False))
        self.sample_button.on_click(lambda _: self._run("sample", self._sample))
        self.refresh_button.on_click(lambda _: self._run("refresh", self.refresh))
        self.history.observe(lambda _: self._show_step(), names="value")
        self.slot.observe(lambda _: self._show_slot(), names="value")
        self.widget = w.VBox([
            w.HTML(STYLE, layout=w.Layout(height="0px", margin="0")),
            w.HBox([self.prompt, self.max_new_tokens, self.add_button], layout=w.Layout(**wrap)),
            w.HBox([self.prefill_button, self.decode_button, self.step_button, self.sample_button,
                    self.auto_sample, self.refresh_button, self.busy], layout=w.Layout(**wrap)),
            self.message, self.session_view,
            w.HBox([self.history], layout=w.Layout(**wrap)), self.step_view,
            w.HBox([self.topk_view, w.VBox([self.slot, self.slot_view], layout=w.Layout(flex="1 1 360px",
                                                                                       min_width="0"))],
                   layout=w.Layout(**{**wrap, "align_items": "flex-start"})),
        ])
        self.widget.add_class("qwen-npu-explorer")
        for part, name in ((self.prompt, "prompt"), (self.auto_sample, "auto-sample"), (self.busy, "busy"),
                           (self.message, "message"), (self.session_view, "session"), (self.history, "history"),
                           (self.step_view, "step"), (self.topk_view, "topk"), (self.slot, "slot-number"),
                           (self.slot_view, "slot")):
            part.add_class(f"qwen-npu-{name}")           # stable names for styling and browser tests
        self.refresh()
        self._say("ready: add a request, then prefill / decode step / step")

    # ---- actions -------------------------------------------------------------------------------
    def _run(self, label: str, fn, *args, **kwargs) -> None:
        """Run one button's action with a progress indicator shown and the controls disabled (so a
        long step cannot be started twice); whatever happens, the controls come back."""
        self.busy.value = progress_html(f"running {label}")
        for c in self._controls:
            c.disabled = True
        try:
            fn(*args, **kwargs)
        except KeyboardInterrupt:
            self.refresh()
            self.message.value = message_html(f"<b>{h.esc(label)} interrupted</b> (KeyboardInterrupt); the views "
                                              "show the session as it is now", ok=False)
        finally:
            for c in self._controls:
                c.disabled = False
            self.history.disabled = not self.session.history
            self.busy.value = ""

    def add_request(self) -> None:
        from ..engine.request import SamplingParams
        text = self.prompt.value
        try:
            if not text.strip():
                raise ValueError("type a prompt (text, or comma-separated token ids) first")
            req = self.session.add_request(parse_prompt(text),
                                           SamplingParams(max_new_tokens=int(self.max_new_tokens.value)))
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            return self._error("add request", e)
        self.prompt.value = ""
        self.refresh()
        self._say(f"added request {req.id} ({len(req.prompt_token_ids)} prompt tokens)")

    def _act(self, name: str, fn, *, sample: bool | None = None) -> None:
        sample = self.auto_sample.value if sample is None else sample
        try:
            step = fn()
            if sample and step.logits is not None and step.sampled_tokens is None:
                self.session.sample(step)
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.refresh()
            return self._error(name, e)
        self.refresh()
        self._say(f"{name}: step {step.index} ran {step.batch_size} row(s), "
                  f"{int(step.query_lens.sum())} token(s)"
                  + (f", sampled {step.sampled_tokens}" if step.sampled_tokens is not None else ""))

    def _sample(self) -> None:
        try:
            ids = self.session.sample()
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            return self._error("sample", e)
        self.refresh()
        self._say(f"sampled {len(ids)} token(s) of step {self.session.last_step.index}")

    # ---- views ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw everything from the session's current state."""
        try:
            self.session_view.value = paper(take_session(self.session)._repr_html_())
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.session_view.value = paper(h.bad_line(f"cannot draw the session: {e}"))
            return
        n = len(self.session.history)
        self.history.max = max(0, n - 1)
        self.history.disabled = n == 0
        if self.history.value != self.history.max:
            self.history.value = self.history.max        # observers redraw the step
        else:
            self._show_step()
        self._show_topk()
        self._show_slot()

    def _show_step(self) -> None:
        hist = self.session.history
        if not hist:
            self.step_view.value = paper(h.muted("no step has run yet"))
            return
        i = min(self.history.value, len(hist) - 1)
        self.step_view.value = paper(take_step(hist[i], self.session.config.block_size)._repr_html_())

    def _show_topk(self) -> None:
        """Top-k of the last step, read from the device once per step (the copy is counted)."""
        last = self.session.last_step
        if last is None or last.logits is None:
            self.topk_view.value = paper(h.view("Top-k next tokens", h.muted("the last step produced no logits")))
            return
        if self._topk_of is last:
            return
        tok = self.session.tokenizer
        try:
            self.topk_view.value = paper(topk(last, self.k, tok.decode if tok is not None else None)._repr_html_())
            self._topk_of = last
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.topk_view.value = paper(h.view("Top-k next tokens", h.bad_line(str(e))))

    def _show_slot(self) -> None:
        try:
            self.slot_view.value = paper(inspect_slot(self.session, int(self.slot.value))._repr_html_())
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.slot_view.value = paper(h.bad_line(str(e)))

    def _say(self, text: str) -> None:
        self.message.value = message_html(h.esc(text), ok=True)

    def _error(self, action: str, e: Exception) -> None:
        self.message.value = message_html(f"<b>{h.esc(action)} failed: {h.esc(type(e).__name__)}</b>: "
                                          f"{h.esc(e)}", ok=False)

    # ---- display -------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        bundle = dict(bundle or {})
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        s = self.session
        return (f"Explorer(session with {len(s.requests)} requests, {len(s.history)} steps in history; "
                f"display it in a notebook to use the buttons)")


def explore(sess, *, k: int = 5, max_new_tokens: int = 8) -> Explorer:
    """Interactive widgets over ``sess``: add requests, run steps, inspect slots and top-k tokens."""
    return Explorer(sess, k=k, max_new_tokens=max_new_tokens)
