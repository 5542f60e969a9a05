"""The Session options are spelled once (``SessionOptions``): ``from_pretrained`` shows and takes
exactly them, with their defaults; an unknown keyword is named with its close matches."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from qwen_npu import InvalidRequestError, Session, SessionOptions, UnknownOptionError

# the keywords and defaults of Session.from_pretrained, as docs/api.md states them
DOCUMENTED = {"device": "auto", "dtype": "auto", "max_batch": 16, "block_size": None, "num_blocks": None,
                  "max_model_len": None, "chunk_size": 512, "prefix_cache": True, "device_outputs": None,
                  "slot_check": "raise", "decode_padding": "runtime", "kernels": "auto", "kv_memory": None,
                  "deterministic": False, "sync_timings": None, "mixed_steps": False, "revision": None,
                  "speculative": None, "num_speculative_tokens": None, "tensor_parallel_size": 1}


def test_from_pretrained_shows_every_option_with_its_default():
    params = inspect.signature(Session.from_pretrained).parameters
    assert list(params) == ["path", *DOCUMENTED]
    shown = {name: p.default for name, p in params.items() if name != "path"}
    assert shown == DOCUMENTED
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name != "path")
    assert SessionOptions().kwargs() == DOCUMENTED
    doc = inspect.getdoc(Session.from_pretrained)
    assert all(f"{name}={default!r}: " in doc for name, default in DOCUMENTED.items())


def test_an_unknown_keyword_is_named_with_its_close_matches(tmp_path):
    with pytest.raises(UnknownOptionError, match="unknown option 'blocksize'; did you mean 'block_size'") as info:
        Session.from_pretrained(tmp_path, blocksize=16)
    assert isinstance(info.value, TypeError) and isinstance(info.value, InvalidRequestError)
    with pytest.raises(TypeError, match="unknown option 'colour'.*the options: device, dtype"):
        Session.from_pretrained(tmp_path, colour="red")


def test_options_are_frozen_and_checked_on_every_copy():
    opts = SessionOptions(block_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.block_size = 4
    assert opts.replace(max_batch=2).max_batch == 2 and opts.max_batch == 16
    with pytest.raises(InvalidRequestError, match="max_batch=0 must be an int >= 1"):
        opts.replace(max_batch=0)
    with pytest.raises(UnknownOptionError, match="'max_batches'; did you mean 'max_batch'"):
        opts.replace(max_batches=2)


def test_speculative_options_are_checked_together():
    assert SessionOptions(speculative="ngram").num_speculative_tokens is None
    assert SessionOptions(speculative="ngram", num_speculative_tokens=5).num_speculative_tokens == 5
    with pytest.raises(InvalidRequestError, match="speculative='eagle' must be None .off. or one of 'ngram'"):
        SessionOptions(speculative="eagle")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens=2 needs speculative='ngram'"):
        SessionOptions(num_speculative_tokens=2)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens=0 must be None"):
        SessionOptions(speculative="ngram", num_speculative_tokens=0)


def test_integral_numbers_become_ints():
    import numpy as np
    opts = SessionOptions(max_batch=np.int64(4), block_size=np.int32(8))
    assert (opts.max_batch, opts.block_size) == (4, 8) and type(opts.max_batch) is int
