"""qwen_npu: step through Qwen3 serving with a paged KV cache, and look at every piece of state."""
# device first: where torch itself cannot load (torch-npu without CANN) it says how to fix that
from . import device  # noqa: F401  isort: skip
from .cache.slot_check import check_slot_mapping
from .engine.outputs import DeviceLogits, StepResult
from .engine.request import Completion, Request, SamplingParams
from .errors import (CheckpointError, DeviceError, InvalidRequestError, OutOfBlocksError, QwenNpuError,
                     SlotCollisionError, StaleOutputError)
from .session import Session

__all__ = [
    "Session", "SamplingParams", "Request", "Completion", "StepResult", "DeviceLogits",
    "check_slot_mapping",
    "QwenNpuError", "CheckpointError", "DeviceError", "InvalidRequestError", "OutOfBlocksError",
    "SlotCollisionError", "StaleOutputError",
]
