"""qwen_npu: step through Qwen3 serving with a paged KV cache, and look at every piece of state."""
from .errors import (CheckpointError, DeviceError, InvalidRequestError, OutOfBlocksError, QwenNpuError,
                     SlotCollisionError, StaleOutputError)

__all__ = ["CheckpointError", "DeviceError", "InvalidRequestError", "OutOfBlocksError", "QwenNpuError",
           "SlotCollisionError", "StaleOutputError"]
