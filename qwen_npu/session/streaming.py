"""``sess.stream(prompts)``: text increments per request as tokens arrive.

    for ev in sess.stream(["Write a haiku", "Count to 5"]):
        print(ev.text, end="", flush=True)          # works in a terminal and a notebook cell

Each event carries the text a step completed for one request. Text is never split inside a
character (an incomplete UTF-8 tail waits for the tokens that complete it) nor released while it
could still be the start of a stop string, so the concatenation of a request's event texts is
exactly its final ``Request.text`` / ``Completion.text``. Closing the generator early (``break``)
aborts the requests it started that have not finished.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ..engine.detokenizer import IncrementalDetokenizer
from ..engine.request import Request


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New output of one request since its previous event."""

    index: int                          # position of the prompt in the list given to ``stream``
    request_id: int
    text: str                           # new text ("" while a character or stop string is pending)
    token_ids: tuple[int, ...]          # tokens appended since the previous event
    finish_reason: str | None = None    # set on the request's last event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def stream(sess, prompts, sampling=None, chat_kwargs: dict | None = None) -> Iterator[StreamEvent]:
    """Add ``prompts`` (validated all first), then step the session and yield StreamEvents
    until they all finish. Other requests in the session advance too (continuous batching)."""
    reqs = sess._add_batch(prompts, sampling, "stream", chat_kwargs or {})
    return _events(sess, reqs)


def _events(sess, reqs: list[Request]) -> Iterator[StreamEvent]:
    decode = sess.tokenizer.decode if sess.tokenizer is not None else None
    texts = [TextIncrements(r, decode) for r in reqs]
    try:
        while not all(t.done for t in texts):
            sess.step()
            for i, t in enumerate(texts):
                ev = t.poll(i)
                if ev is not None:
                    yield ev
    finally:
        for r in reqs:
            if not r.is_done and sess.state.requests.get(r.id) is r:
                sess.abort(r)


class TextIncrements:
    """One request's output, released as increments that always form a prefix of its final text."""

    def __init__(self, req: Request, decode):
        self.req = req
        self.done = False
        self._seen = 0
        self._sent = ""
        self._text = IncrementalDetokenizer(decode) if decode is not None else None
        self._stops = req.sampling.stop or ()

    def poll(self, index: int) -> StreamEvent | None:
        """The event for what changed since the last poll, or None when nothing did."""
        if self.done:
            return None
        req = self.req
        new_ids = tuple(req.output_token_ids[self._seen:])
        self._seen += len(new_ids)
        if not new_ids and not req.is_done:
            return None
        text = ""
        if self._text is not None:
            self._text.push(new_ids)
            if req.is_done:
                visible = req.text
            else:
                stable = self._text.text
                visible = stable[:len(stable) - pending_stop_prefix(stable, self._stops)]
            text = visible[len(self._sent):]
            self._sent = visible
        self.done = req.is_done
        return StreamEvent(index, req.id, text, new_ids, req.finish_reason if self.done else None)


def pending_stop_prefix(text: str, stops) -> int:
    """The length of the longest end of ``text`` that begins some stop string (0 when none)::

        pending_stop_prefix("hello wor", ["world"]) == 3      # "wor" may become "world"
    """
    best = 0
    for s in stops:
        for n in range(min(len(s), len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
