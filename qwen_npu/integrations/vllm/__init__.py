"""Guard a running vLLM: qwen_npu's slot checks before every forward of each worker.

Install with the `vllm-guard` extra (it declares the `vllm.general_plugins` entry point
`qwen_npu_slot_guard = qwen_npu.integrations.vllm:register`) and switch it on per run::

    QWEN_NPU_VLLM_GUARD=warn  vllm serve ...      # log each problem, keep serving
    QWEN_NPU_VLLM_GUARD=count                     # count only; a summary is logged at exit
    QWEN_NPU_VLLM_GUARD=raise                     # SlotCollisionError before the bad forward
    QWEN_NPU_VLLM_GUARD_LOG=/path/guard.jsonl     # also one JSON line per step with problems

Unset (or "off"), the plugin does nothing at all. vLLM loads general plugins in every process;
the guard wraps the model runner's `execute_model` / `_model_forward` when the runner's module is
imported, so only workers pay for it. Supported: vLLM 0.32 (V1 model runner: `GPUModelRunner` and
the CPU build's `CPUModelRunner`) and vllm-ascend's `NPUModelRunner` (V1). Anything else is left
alone and said so once.
"""
from __future__ import annotations

import atexit
import logging
import os

from ..step_guard import MODES, StepGuard
from .notices import SUPPORTED_VLLM, SUPPORTED_VLLM_ASCEND, log, say_once

ENV = "QWEN_NPU_VLLM_GUARD"
LOG_ENV = "QWEN_NPU_VLLM_GUARD_LOG"

_guard: StepGuard | None = None


def mode_from_env(environ=os.environ) -> str | None:
    """The requested mode, or None when the guard is off; a bad value is a clear error."""
    raw = environ.get(ENV, "").strip().lower()
    if raw in ("", "off", "0", "false", "no"):
        return None
    if raw not in MODES:
        raise ValueError(f"{ENV}={environ.get(ENV)!r}: expected one of {', '.join(MODES)} or off")
    return raw


def guard() -> StepGuard | None:
    """This process's guard (None until `register` switched it on)."""
    return _guard


def register() -> None:
    """The `vllm.general_plugins` entry point: switch the guard on if `QWEN_NPU_VLLM_GUARD` asks."""
    global _guard
    mode = mode_from_env()
    if mode is None:
        return
    import vllm
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM + SUPPORTED_VLLM_ASCEND):
        say_once("version", f"vLLM {version} is not supported (0.32.x; 0.27-0.32 with vllm-ascend); "
                            f"not checking anything")
        return
    if not log.handlers and not logging.getLogger().handlers:   # vLLM configures only its own logger
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    if _guard is None:
        _guard = StepGuard(mode, log_path=os.environ.get(LOG_ENV) or None)
        atexit.register(_at_exit)
    from .patch import install
    install(_guard, version)


def _at_exit() -> None:
    if _guard is None or not _guard.steps_checked:
        return
    try:
        _guard.flush()
    except Exception as exc:  # noqa: BLE001 - raise mode at exit: report, never mask the exit
        log.error("qwen_npu slot guard: %s", exc)
    log.warning("qwen_npu %s", _guard.summary())
