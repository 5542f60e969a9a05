"""Wrap the model runners' `execute_model` and `_model_forward` when their modules are imported.

`execute_model` marks "a real step is running" (dummy, profiling and capture runs also call
`_model_forward`, but not from `execute_model`, and are not checked); the first `_model_forward`
inside it hands the step to the guard, before the model (and the KV writes) run.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys

from ...errors import SlotCollisionError
from ..step_guard import StepGuard
from .notices import SUPPORTED_VLLM, SUPPORTED_VLLM_ASCEND, say_once
from .runner_steps import ascend_steps, vllm_steps

V1_MODULE, V1_CLASS = "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"
V2_MODULE, V2_CLASS = "vllm.v1.worker.gpu.model_runner", "GPUModelRunner"
ASCEND_MODULE, ASCEND_CLASS = "vllm_ascend.worker.model_runner_v1", "NPUModelRunner"
ASCEND_V2_MODULE = "vllm_ascend.worker.v2.model_runner"
MARK = "__qwen_npu_guard__"

_state = {"guard": None, "version": None}


def install(guard: StepGuard, version: str) -> None:
    """Patch the runners already imported; patch the others as soon as they are imported."""
    _state["guard"], _state["version"] = guard, version
    for name in (V1_MODULE, V2_MODULE, ASCEND_MODULE, ASCEND_V2_MODULE):
        if name in sys.modules:
            _patch_module(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _patch_module(module) -> None:
    name = module.__name__
    if name == V1_MODULE and version_ok("vllm"):
        _wrap(getattr(module, V1_CLASS), vllm_steps)
    elif name == ASCEND_MODULE and version_ok("ascend"):
        _wrap(getattr(module, ASCEND_CLASS), ascend_steps)
    elif name in (V2_MODULE, ASCEND_V2_MODULE):
        cls = getattr(module, "GPUModelRunner" if name == V2_MODULE else "NPUModelRunner", None)
        if cls is not None:
            _wrap_unsupported(cls, "the V2 model runner is not checked (VLLM_USE_V2_MODEL_RUNNER=0 "
                                   "selects the V1 runner, which is)")


def version_ok(engine: str) -> bool:
    v = _state["version"] or ""
    ok = v.startswith(SUPPORTED_VLLM if engine == "vllm" else SUPPORTED_VLLM_ASCEND)
    if not ok:
        say_once("version-" + engine, f"vLLM {v} is not supported for this runner; not checking")
    return ok


def _wrap(cls, steps_of) -> None:
    if getattr(cls.__dict__.get("_model_forward"), MARK, False):
        return
    execute, forward = cls.__dict__.get("execute_model"), cls.__dict__.get("_model_forward")
    if execute is None or forward is None:
        say_once(f"shape-{cls.__name__}", f"{cls.__module__}.{cls.__name__} has no execute_model / "
                                         f"_model_forward of its own; not checking")
        return

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        outer = self.__dict__.get("_qwen_npu_step")
        self._qwen_npu_step = "pending"
        try:
            return execute(self, *args, **kwargs)
        finally:
            self._qwen_npu_step = outer

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        if self.__dict__.get("_qwen_npu_step") == "pending":
            self._qwen_npu_step = "checked"
            _check(self, steps_of)
        return forward(self, *args, **kwargs)

    for f in (execute_model, _model_forward):
        setattr(f, MARK, True)
    cls.execute_model, cls._model_forward = execute_model, _model_forward


def _wrap_unsupported(cls, why: str) -> None:
    execute = cls.__dict__.get("execute_model")
    if execute is None or getattr(execute, MARK, False):
        return

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        say_once("v2", why)
        return execute(self, *args, **kwargs)

    setattr(execute_model, MARK, True)
    cls.execute_model = execute_model


def _check(runner, steps_of) -> None:
    guard = _state["guard"]
    if guard is None or runner.__dict__.get("_qwen_npu_off"):
        return
    try:
        steps = steps_of(runner)
    except Exception as exc:  # noqa: BLE001 - the guard must never take the engine down by itself
        runner._qwen_npu_off = True
        say_once("read", f"cannot read the step from {type(runner).__name__} ({exc!r}); guard off")
        return
    say_once("on", f"checking every step of {type(runner).__name__} before its forward "
                   f"(mode {guard.mode}, vLLM {_state['version']})", logging.INFO)
    for step in steps:
        if isinstance(step, str):
            say_once("skip-" + step, step)
            continue
        try:
            guard.check(step)
        except SlotCollisionError:
            raise
        except Exception as exc:  # noqa: BLE001 - as above
            runner._qwen_npu_off = True
            say_once("check", f"the check failed ({exc!r}); guard off")
            return


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the normal finders load a runner module, then patches it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in (V1_MODULE, V2_MODULE, ASCEND_MODULE, ASCEND_V2_MODULE):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch_module(module)
