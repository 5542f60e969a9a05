"""Every error the toolkit raises derives from QwenNpuError."""


class QwenNpuError(Exception):
    """Base class of all qwen_npu errors."""


class CheckpointError(QwenNpuError):
    """A checkpoint folder cannot be loaded; the message names the file and the tensor."""


class InvalidRequestError(QwenNpuError, ValueError):
    """A request or a call cannot run; refused before any state changed."""


class SlotCollisionError(QwenNpuError):
    """A step would write a KV slot it must not write (names step, rows, requests, slot, block)."""


class StaleOutputError(QwenNpuError):
    """A device output handle whose buffer a later step has reused."""


class OutOfBlocksError(QwenNpuError):
    """One request alone cannot fit in the KV cache (preemption cannot help)."""


class DeviceError(QwenNpuError):
    """A requested device or kernel set is not available here."""


class SessionBusyError(InvalidRequestError):
    """Another thread is inside a call on this Session (or a fork sharing its cache); refused at once."""
