"""Every error the toolkit raises derives from QwenNpuError; ``warn`` is how it warns."""
import functools


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


class CaptureCallbackError(QwenNpuError):
    """A capture's ``on_step`` callback raised for one or more slices of a step that had already
    committed. Every other slice was still delivered and the Session's state is whole; ``step``
    is the committed step, ``failures`` the (which slice, exception) pairs in delivery order,
    ``delivered`` how many slices the step handed over; chained from the first exception."""

    def __init__(self, step: int | None, failures: list[tuple[str, BaseException]], delivered: int):
        self.step, self.failures, self.delivered = step, list(failures), max(delivered, len(failures))
        shown = "; ".join(f"{what} ({type(err).__name__}: {err})" for what, err in self.failures[:3])
        more = f"; and {len(self.failures) - 3} more" if len(self.failures) > 3 else ""
        super().__init__(
            f"step {step} committed, but on_step raised for {len(self.failures)} of its {self.delivered} "
            f"slices: {shown}{more}. Every other slice was delivered and the session's state is whole, "
            f"so the next step can run")


class UnknownOptionError(InvalidRequestError, TypeError):
    """A keyword argument that names no option (the message lists the close matches); both an
    ``InvalidRequestError`` and the ``TypeError`` Python raises for an unknown keyword."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first frame outside this package (``qwen_npu`` and its
    kernels folder, wherever each is installed): the user's line that led to the warning,
    however deep inside the toolkit it was raised."""
    import sys
    import warnings
    prefixes = _package_dirs()
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(prefixes) or _internal(frame)):
        frame = frame.f_back
        level += not _internal(frame)   # warnings.warn skips import machinery frames when it counts
    warnings.warn(message, category, stacklevel=level)


def _internal(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    """The folders whose frames ``warn`` skips, each ending in a path separator."""
    import importlib.util
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.find_spec("qwen_npu.kernels")
    dirs = [here, *(spec.submodule_search_locations or [] if spec is not None else [])]
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)
