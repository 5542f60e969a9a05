"""Admission checks: turn what a user passed as a prompt into validated token ids.

Everything here only reads; a prompt that cannot run is refused before any state changes.
"""
from __future__ import annotations

import torch

from ..text import chat
from ..config import ModelConfig, SessionConfig
from ..errors import InvalidRequestError, OutOfBlocksError
from .request import SamplingParams


def prepare_request(prompt, sampling, model_config: ModelConfig, config: SessionConfig, tokenizer, *,
                    where: str, chat_kwargs: dict | None = None) -> tuple[list[int], str | None, SamplingParams]:
    """(token ids, prompt text or None, SamplingParams) for ``prompt`` — text, token ids, a tensor
    or chat messages — or a clear error saying what is wrong and where."""
    if sampling is None:
        sampling = SamplingParams()
    elif isinstance(sampling, dict):
        sampling = SamplingParams.from_dict(sampling)
    elif not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be a SamplingParams, a dict or None, not {type(sampling).__name__}")
    sampling.validate()
    sampling.validate_for(model_config.vocab_size, has_tokenizer=tokenizer is not None)
    text = None
    if chat.is_messages(prompt):
        prompt = chat.apply_chat_template(tokenizer, prompt, where=where,
                                          **(chat_kwargs or {}))
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(f"{where}: this checkpoint has no tokenizer.json, so prompts "
                                      f"must be lists of token ids, not text")
        text, prompt = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise InvalidRequestError(f"a tensor prompt must be 1-D token ids, not shape {list(prompt.shape)}; "
                                      f"pass one row (t[0]) or t.flatten()")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(f"prompt must be a str, chat messages, or a list of int token ids (a list, "
                                  f"a tuple or a 1-D tensor), not {type(prompt).__name__}"
                                  + ("; decode bytes to str first" if isinstance(prompt, (bytes, bytearray)) else ""))
    items = prompt
    ids = []
    for i, t in enumerate(items):          # ints only: int(1.5) or int(True) would pass silently
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(t.__index__())
        except (AttributeError, TypeError, RuntimeError):
            raise InvalidRequestError(f"prompt token {i} is {t!r} ({type(t).__name__}); token ids must be ints") from None
    if not ids:
        raise InvalidRequestError("prompt is empty: a request needs at least one token")
    vocab = model_config.vocab_size
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
    if bad:
        i, t = bad[0]
        raise InvalidRequestError(f"prompt token {i} is {t}, outside the vocabulary [0, {vocab})")
    total = len(ids) + sampling.max_new_tokens
    if total > config.max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} exceeds "
            f"max_model_len={config.max_model_len}")
    need = -(-(total - 1) // config.block_size)    # the last sampled token is never computed
    if need > config.num_blocks:
        raise OutOfBlocksError(
            f"a request of up to {total} tokens computes {total - 1} and needs {need} blocks of "
            f"{config.block_size}, but the cache has only {config.num_blocks}; raise num_blocks "
            f"or lower max_new_tokens")
    return ids, text, sampling

