"""Incremental detokenisation never splits a character and adds up to the full decode."""
import random

import pytest

from qwen_npu.engine.detokenizer import IncrementalDetokenizer
from qwen_npu.session.streaming import pending_stop_prefix
from qwen_npu.testing import tokenizer_files_dir

PARROT = [123918, 250]          # "🦜" split over two byte-level tokens
MELT = [9284, 104, 254]         # "🫠" over three
ASTRONAUT = [148738, 378, 235, 145836]   # "🧑‍🚀": person, zero-width joiner in two tokens, rocket


@pytest.fixture(scope="module")
def tok():
    from qwen_npu.text.tokenizer import Tokenizer
    return Tokenizer(tokenizer_files_dir()).decode       # the bound decode, as a Request holds it


def test_a_split_character_waits_for_its_last_token(tok):
    d = IncrementalDetokenizer(tok)
    assert d.push([PARROT[0]]) == ""
    assert d.push([PARROT[1]]) == "🦜"
    assert d.push(MELT[:2]) == ""
    assert d.push(MELT[2:]) == "🫠"
    pieces = [d.push([t]) for t in ASTRONAUT]
    assert pieces[1] == "" and "".join(pieces) == "🧑\u200d🚀"
    assert d.text == "🦜🫠🧑\u200d🚀" == tok(PARROT + MELT + ASTRONAUT)


def test_pieces_add_up_to_the_full_decode_for_random_tokens(tok):
    rng = random.Random(0)
    partial = PARROT + MELT + ASTRONAUT + [246, 104, 250, 254]
    for _ in range(30):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(151643) for _ in range(40)]
        ids += [151645] if rng.random() < 0.3 else []       # a special token decodes to nothing
        d = IncrementalDetokenizer(tok)
        pieces = [d.push([t]) for t in ids] + [d.finish()]
        assert "".join(pieces) == tok(ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])     # no piece ends mid-character


def test_finish_flushes_an_incomplete_tail(tok):
    d = IncrementalDetokenizer(tok)
    assert d.push([PARROT[0]]) == ""
    assert d.finish() == tok([PARROT[0]])


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3), ("hello", ["world"], 0), ("ab", ["abc", "b"], 2), ("xx", ["xx"], 2),
    ("", ["a"], 0),
])
def test_pending_stop_prefix(text, stops, held):
    assert pending_stop_prefix(text, stops) == held


def test_a_copy_steps_on_independently(tok):
    d = IncrementalDetokenizer(tok)
    d.push([MELT[0]])
    c = d.copy()
    assert d.push(MELT[1:]) == "🫠" and d.token_ids == MELT
    assert c.text == "" and c.token_ids == MELT[:1]
    assert c.push([MELT[1]]) == "" and c.push(PARROT) == tok([MELT[0], MELT[1]] + PARROT)
