"""qwen_npu: step through Qwen3 serving with a paged KV cache, and look at every piece of state."""
# device first: where torch itself cannot load (torch-npu without CANN) it says how to fix that
from . import device  # noqa: F401  isort: skip
from .cache.slot_check import SlotCollisionWarning, check_slot_mapping
from .engine.step import StreamHealthWarning
from .engine.faults import FaultEmulationWarning
from .engine.plan import StepResult
from .engine.request import Completion, Request, SamplingParams
from .engine.runner import DeviceLogits
from .errors import (CheckpointError, DeviceError, InvalidRequestError, OutOfBlocksError, QwenNpuError,
                     SessionBusyError, SlotCollisionError, StaleOutputError, UnknownOptionError)
from .session.options import SessionOptions
from .research.batch_compare import compare_batched
from .research.compare import compare
from .session.session import Session
from .dump import Dump, load_dump  # noqa: E402  isort: skip
from .engine.logprobs import TokenLogprob  # noqa: E402  isort: skip
from .tools.env import EnvReport, env_report  # noqa: E402  isort: skip
from .tools.kernel_build import build_kernels  # noqa: E402  isort: skip
from .session.memory import MemoryReport  # noqa: E402  isort: skip
from .session.scoring import ScoreResult  # noqa: E402  isort: skip
from .session.streaming import StreamEvent  # noqa: E402  isort: skip
# the inspect and research namespaces (the Session's methods import what they use from them when called)
from . import inspect, research  # noqa: E402,F401  isort: skip

__all__ = [
    "Session", "SessionOptions", "SamplingParams", "Request", "Completion", "StepResult", "DeviceLogits",
    "check_slot_mapping", "SlotCollisionWarning", "StreamHealthWarning", "FaultEmulationWarning",
    "QwenNpuError", "CheckpointError", "DeviceError", "InvalidRequestError", "OutOfBlocksError",
    "SlotCollisionError", "StaleOutputError", "SessionBusyError", "UnknownOptionError",
    "compare", "compare_batched",
    "load_dump", "Dump", "env_report", "EnvReport", "build_kernels", "TokenLogprob", "StreamEvent", "ScoreResult",
    "MemoryReport",
]
