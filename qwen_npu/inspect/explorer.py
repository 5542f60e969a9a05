"""An ipywidgets explorer that drives a Session step by step and shows its state.

    ┌ prompt [..............] max new [8] [add request]                                   ┐
    │ [prefill] [decode step] [step] [sample] [x] sample after prefill/decode  [refresh]  │
    │ message: what the last button did, or the session's error                           │
    │ session: model, cache bar, block-occupancy grid, requests table                     │
    │ step history slider ──> that step's rows, block tables and slots                    │
    │ top-k next tokens of the last step │ slot [n] ──> owner, position, writes, K/V norms │
    └─────────────────────────────────────────────────────────────────────────────────────┘

It drives the same Session object the notebook holds: run code cells in between, then press
"refresh" (every button refreshes too). Errors from the session are shown, never raised.
"""
from __future__ import annotations

import re

from . import html as h
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
        self.prompt = w.Text(placeholder="prompt text, or comma-separated token ids", description="prompt",
                             layout=w.Layout(width="460px"))
        self.max_new_tokens = w.BoundedIntText(value=max_new_tokens, min=1, max=sess.config.max_model_len,
                                               description="max new", layout=w.Layout(width="160px"))
        self.add_button = w.Button(description="add request", button_style="primary")
        self.prefill_button = w.Button(description="prefill")
        self.decode_button = w.Button(description="decode step")
        self.step_button = w.Button(description="step", tooltip="schedule + run + sample one step")
        self.sample_button = w.Button(description="sample")
        self.refresh_button = w.Button(description="refresh")
        self.auto_sample = w.Checkbox(value=True, description="sample after prefill/decode", indent=False)
        self.message = w.HTML()
        self.session_view = w.HTML()
        self.history = w.IntSlider(value=0, min=0, max=0, description="step", continuous_update=False)
        self.step_view = w.HTML()
        self.topk_view = w.HTML()
        num_slots = sess.config.num_blocks * sess.config.block_size
        self.slot = w.BoundedIntText(value=0, min=0, max=num_slots - 1, description="slot",
                                     layout=w.Layout(width="160px"))
        self.slot_view = w.HTML()
        self._topk_of = None                  # the step whose top-k is shown
        self.add_button.on_click(lambda _: self.add_request())
        self.prefill_button.on_click(lambda _: self._act("prefill", sess.prefill))
        self.decode_button.on_click(lambda _: self._act("decode step", sess.decode_step))
        self.step_button.on_click(lambda _: self._act("step", sess.step, sample=False))
        self.sample_button.on_click(lambda _: self._sample())
        self.refresh_button.on_click(lambda _: self.refresh())
        self.history.observe(lambda _: self._show_step(), names="value")
        self.slot.observe(lambda _: self._show_slot(), names="value")
        self.widget = w.VBox([
            w.HBox([self.prompt, self.max_new_tokens, self.add_button]),
            w.HBox([self.prefill_button, self.decode_button, self.step_button, self.sample_button,
                    self.auto_sample, self.refresh_button]),
            self.message, self.session_view,
            w.HBox([self.history]), self.step_view,
            w.HBox([self.topk_view, w.VBox([self.slot, self.slot_view])]),
        ])
        self.refresh()
        self._say("ready: add a request, then prefill / decode step / step")

    # ---- actions -------------------------------------------------------------------------------
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
            if sample and step.logits is not None and step.token_ids is None:
                self.session.sample(step)
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.refresh()
            return self._error(name, e)
        self.refresh()
        self._say(f"{name}: step {step.index} ran {step.batch_size} row(s), "
                  f"{int(step.query_lens.sum())} token(s)"
                  + (f", sampled {step.token_ids.tolist()}" if step.token_ids is not None else ""))

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
            self.session_view.value = take_session(self.session)._repr_html_()
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.session_view.value = h.bad_line(f"cannot draw the session: {e}")
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
            self.step_view.value = h.muted("no step has run yet")
            return
        i = min(self.history.value, len(hist) - 1)
        self.step_view.value = take_step(hist[i], self.session.config.block_size)._repr_html_()

    def _show_topk(self) -> None:
        """Top-k of the last step, read from the device once per step (the copy is counted)."""
        last = self.session.last_step
        if last is None or last.logits is None:
            self.topk_view.value = h.view("Top-k next tokens", h.muted("the last step produced no logits"))
            return
        if self._topk_of is last:
            return
        tok = self.session.tokenizer
        try:
            self.topk_view.value = topk(last, self.k, tok.decode if tok is not None else None)._repr_html_()
            self._topk_of = last
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.topk_view.value = h.view("Top-k next tokens", h.bad_line(str(e)))

    def _show_slot(self) -> None:
        try:
            self.slot_view.value = inspect_slot(self.session, int(self.slot.value))._repr_html_()
        except Exception as e:  # noqa: BLE001 - shown in the widget, never raised
            self.slot_view.value = h.bad_line(str(e))

    def _say(self, text: str) -> None:
        self.message.value = f'<div style="{h.FONT};color:{h.OK_COLOR}">{h.esc(text)}</div>'

    def _error(self, action: str, e: Exception) -> None:
        self.message.value = (f'<div style="{h.FONT};color:{h.BAD_COLOR}"><b>{h.esc(action)} failed: '
                              f'{h.esc(type(e).__name__)}</b>: {h.esc(e)}</div>')

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
