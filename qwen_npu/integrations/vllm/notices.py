"""What the vLLM plugin supports and how it speaks: once per subject, on its own logger."""
from __future__ import annotations

import logging

SUPPORTED_VLLM = ("0.32.",)                          # vLLM's own V1 runner, read and tested
SUPPORTED_VLLM_ASCEND = ("0.27.", "0.28.", "0.29.", "0.30.", "0.31.", "0.32.")
log = logging.getLogger("qwen_npu.guard")

_said: set[str] = set()


def say_once(key: str, text: str, level: int = logging.WARNING) -> None:
    """Log `text` the first time `key` is seen in this process."""
    if key not in _said:
        _said.add(key)
        log.log(level, "qwen_npu slot guard: %s", text)
