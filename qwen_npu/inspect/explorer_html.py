"""The explorer's own HTML pieces: the message line, the progress indicator and the light "paper"
every drawn view sits on.

The views are drawn with fixed colours for a white page (see ``html``); on the paper they read the
same under a dark notebook theme. The message line is on the same paper, marked green or red.
"""
from __future__ import annotations

from . import html as h

PAPER = "background:#ffffff;color:#1f2328;border-radius:4px;overflow-x:auto"

# The one style rule of the explorer, scoped to it: in the explorer's column, narrower than a
# notebook output, the views' "name value" fields (a step's timings, for one) may wrap inside
# their value instead of pushing the page sideways.
STYLE = ('<style>.qwen-npu-explorer .qwen-npu-paper span[style*="white-space:nowrap"]'
         "{white-space:normal !important}</style>")


def paper(body: str) -> str:
    """A view on white paper with dark text, whatever the notebook theme."""
    return f'<div class="qwen-npu-paper" style="{PAPER};padding:2px 4px">{body}</div>'


def message_html(body: str, *, ok: bool) -> str:
    """One line saying what the last action did (``ok``) or why it failed; ``body`` is HTML."""
    color = h.OK_COLOR if ok else h.BAD_COLOR
    return (f'<div role="status" style="{PAPER};{h.FONT};border-left:4px solid {color};padding:2px 8px;'
            f'color:{color}">{body}</div>')


def progress_html(label: str) -> str:
    """An animated, indeterminate progress bar (the browser's own ``<progress>``) and a label."""
    return (f'<span style="{h.FONT};white-space:nowrap"><progress style="width:80px;vertical-align:middle">'
            f'</progress> {h.esc(label)}...</span>')
