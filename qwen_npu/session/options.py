"""The options of ``Session.from_pretrained``, spelled once: one frozen dataclass whose fields carry
the defaults and a one-line meaning each, and one check of every value.

    Session.from_pretrained(path, **options) ─> SessionOptions.from_kwargs(options)  (every value checked)
        ─> loading.load_session(path, options) ─> SessionConfig                       (defaults resolved)

``None`` in a field means "resolve when the session is made" (from the device, the checkpoint or an
environment variable; see each field's meaning). Every refusal is an ``InvalidRequestError`` naming
the option and its value; a keyword that names no option is an ``UnknownOptionError`` listing the
close matches. Derive a changed copy with ``options.replace(name=value)`` (checked the same way).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
from typing import Any

import torch

from ..errors import InvalidRequestError, UnknownOptionError

WHERE = "Session.from_pretrained"
SLOT_CHECKS = ("raise", "warn", "off")
DECODE_PADDINGS = ("runtime", "replicate")
KERNEL_SETS = ("auto", "reference", "npu", "cpu", "cuda")


def _option(default, doc: str):
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """What ``Session.from_pretrained`` accepts, with its defaults; checked on construction."""

    device: Any = _option("auto", '"auto" (npu if torch_npu sees one, else cuda, else cpu) | "npu[:N]" | '  # noqa: RUF009
                                  '"cuda[:N]" | "cpu" | a torch.device')
    dtype: Any = _option("auto", '"auto" (the checkpoint\'s) | "float32" | "float16" | "bfloat16" | a torch dtype')  # noqa: RUF009
    max_batch: int = _option(16, "the most requests in one step")
    block_size: int | None = _option(None, "tokens per KV block; None = 128 on npu, 16 elsewhere")
    num_blocks: int | None = _option(None, "KV blocks; None = enough for max_batch full-length sequences, capped "
                                           "by a memory budget (4 GiB on the CPU, half the free device memory)")
    max_model_len: int | None = _option(None, "the most tokens of one request; None = "
                                              "min(max_position_embeddings, 8192)")
    chunk_size: int = _option(512, "the most prompt tokens in one prefill step (with mixed_steps, in any step)")
    prefix_cache: bool = _option(True, "reuse the cached full blocks of a prompt's prefix")
    device_outputs: bool | None = _option(None, "logits stay on the device; None = QWEN_NPU_DEVICE_OUTPUTS, "
                                                "read now (unset or anything but '0' is on)")
    slot_check: str = _option("raise", '"raise" | "warn" | "off": the slot checks run before every dispatch')
    decode_padding: str = _option("runtime", '"runtime" (dispatch only active rows) | "replicate" '
                                             '(inactive rows copy row 0; all max_batch rows dispatched)')
    kernels: str = _option("auto", '"auto" | "reference" | "npu" | "cpu" | "cuda" (see docs/api.md)')
    kv_memory: Any = _option(None, 'KV cache budget: bytes ("2GiB", "512MB", an int) or a fraction in (0, 1] '  # noqa: RUF009
                                   'of the memory free after loading; not with num_blocks')
    deterministic: bool = _option(False, "batch-invariant kernels: results independent of batch and chunking")
    sync_timings: bool | None = _option(None, "end the prepare and forward phases at a device sync; "
                                              "None = QWEN_NPU_SYNC_TIMINGS, read now ('1' is on)")
    mixed_steps: bool = _option(False, "step()/generate() put decode rows and prefill chunks in one forward")
    revision: str | None = _option(None, "a branch, tag or commit of a Hugging Face repo id (not for a folder)")
    speculative: str | None = _option(None, 'None (off) | "ngram": step()/generate() verify drafts proposed from '
                                            "each request's own tokens, several tokens per decode row")
    num_speculative_tokens: int | None = _option(None, "drafts per decode row; None = 3 with speculative, "
                                                       "else not allowed")
    tensor_parallel_size: int = _option(1, "ranks the model is split over, one device each, through "
                                           "torch.distributed (gloo on cpu, nccl on cuda, hccl on npu); "
                                           "this process is rank 0")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every option; ints are normalised to ``int``. Reads no file and no device."""
        for name in ("max_batch", "chunk_size"):
            self._int(name, optional=False)
        for name in ("block_size", "num_blocks", "max_model_len"):
            self._int(name, optional=True)
        for name in ("prefix_cache", "deterministic", "mixed_steps"):
            self._bool(name, optional=False)
        for name in ("device_outputs", "sync_timings"):
            self._bool(name, optional=True)
        for name, choices in (("slot_check", SLOT_CHECKS), ("decode_padding", DECODE_PADDINGS),
                              ("kernels", KERNEL_SETS)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                self._bad(name, f"must be one of {', '.join(map(repr, choices))}")
        if not isinstance(self.device, (str, torch.device)):
            self._bad("device", "must be a string such as 'auto', 'cpu', 'cuda:0', 'npu:0', or a torch.device")
        if self.dtype != "auto":
            from ..model.loader import resolve_dtype
            try:
                resolve_dtype(self.dtype, None)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{WHERE}: {e}") from None
        if self.kv_memory is not None:
            if self.num_blocks is not None:
                raise InvalidRequestError(f"{WHERE}: give num_blocks or kv_memory, not both "
                                          f"(num_blocks={self.num_blocks!r}, kv_memory={self.kv_memory!r})")
            from .memory import parse_memory
            try:
                parse_memory(self.kv_memory)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{WHERE}: {e}") from None
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            self._bad("revision", "must be None or a branch, tag or commit name")
        from ..engine.speculative import DRAFTERS
        if self.speculative is not None and self.speculative not in DRAFTERS:
            self._bad("speculative", f"must be None (off) or one of {', '.join(map(repr, DRAFTERS))}")
        self._int("num_speculative_tokens", optional=True)
        self._int("tensor_parallel_size", optional=False)
        if self.tensor_parallel_size > 1:
            for name, on in (("speculative", self.speculative is not None), ("deterministic", self.deterministic)):
                if on:
                    self._bad(name, f"is not available with tensor_parallel_size={self.tensor_parallel_size} yet "
                                    f"(one rank only)")
        if self.num_speculative_tokens is not None and self.speculative is None:
            self._bad("num_speculative_tokens", "needs speculative='ngram' (drafts need a drafter)")

    def _bad(self, name: str, why: str):
        raise InvalidRequestError(f"{WHERE}: {name}={getattr(self, name)!r} {why}")

    def _int(self, name: str, *, optional: bool) -> None:
        v = getattr(self, name)
        if v is None and optional:
            return
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            self._bad(name, "must be " + ("None (the default) or " if optional else "") + "an int >= 1")
        object.__setattr__(self, name, int(v))

    def _bool(self, name: str, *, optional: bool) -> None:
        v = getattr(self, name)
        if not (isinstance(v, bool) or (optional and v is None)):
            self._bad(name, "must be True or False" + (" (or None: see the default)" if optional else ""))

    # ---- keywords <-> options ------------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> SessionOptions:
        """The options for ``Session.from_pretrained(path, **kwargs)``; an unknown keyword raises
        ``UnknownOptionError`` naming it and the close matches."""
        check_names(kwargs)
        return cls(**kwargs)

    def replace(self, **changes) -> SessionOptions:
        """A checked copy with ``changes`` applied (unknown names refused as in ``from_kwargs``)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)

    def kwargs(self) -> dict[str, Any]:
        """Every option by name: ``Session.from_pretrained(path, **options.kwargs())``."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def keywords(cls, fn):
        """Decorator: ``fn(..., **options)`` shows every option as a keyword-only parameter with its
        default in ``inspect.signature`` and ``help()``, and lists their meanings in its docstring."""
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
                   for f in dataclasses.fields(cls)]
        fn.__signature__ = sig.replace(parameters=params)
        lines = [f"    {f.name}={f.default!r}: {f.metadata['doc']}" for f in dataclasses.fields(cls)]
        fn.__doc__ = (inspect.cleandoc(fn.__doc__ or "") + "\n\nOptions (qwen_npu.SessionOptions):\n"
                      + "\n".join(lines))
        return fn


def check_names(kwargs: dict) -> None:
    """Refuse any keyword that names no Session option, listing the close matches."""
    known = SessionOptions.names()
    for name in kwargs:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
            raise UnknownOptionError(f"{WHERE}: unknown option {name!r}{hint} "
                                     f"(the options: {', '.join(known)})")
