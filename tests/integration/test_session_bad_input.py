"""Bad input: each call fails with a clear InvalidRequestError before any state changes, and the
session stays usable (a normal generate still runs afterwards)."""
import math

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session
from session_kit import greedy, open_session, prompts, state

MAX_LEN = 40
GOOD = prompts((5,))[0]


@pytest.fixture
def busy(tiny_ckpt_small_vocab):
    """A session with one decoding request, one waiting request and a sampled last step."""
    sess = open_session(tiny_ckpt_small_vocab, max_model_len=MAX_LEN)
    sess.sample(sess.prefill([sess.add_request(GOOD, greedy(6))]))
    sess.add_request(prompts((7,), seed=1)[0], greedy(6))
    return sess


def still_usable(sess, before):
    assert state(sess) == before, "a refused call changed the session"
    out = sess.generate([GOOD], greedy(3), progress=False)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


NAN = math.nan
BAD_SAMPLING = [
    ("temperature", -0.5), ("temperature", NAN), ("temperature", math.inf),
    ("top_p", NAN), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5),
    ("top_k", -1), ("top_k", NAN), ("top_k", 2.5),
    ("max_new_tokens", -1), ("max_new_tokens", 0), ("max_new_tokens", NAN), ("max_new_tokens", 2.0),
    ("seed", -3),
]


@pytest.mark.parametrize("field, value", BAD_SAMPLING, ids=[f"{f}={v}" for f, v in BAD_SAMPLING])
def test_bad_sampling_params(busy, field, value):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match=field):
        busy.add_request(GOOD, {field: value})
    with pytest.raises(InvalidRequestError, match=field):
        busy.generate([GOOD, GOOD], {field: value}, progress=False)
    still_usable(busy, before)


BAD_PROMPTS = [
    ("empty", [], "empty"),
    ("negative id", [3, -1, 4], r"token 1 is -1, outside the vocabulary \[0, 512\)"),
    ("id == vocab", [3, 512], r"token 1 is 512, outside the vocabulary"),
    ("huge id", [2**40], "outside the vocabulary"),
    ("float id", [3, 1.5], "int"),
    ("bool id", [True], "int"),
    ("not a list", 17, "list of int"),
    ("nested", [[1, 2]], "int"),
    ("None", None, "list of int"),
    ("text without tokenizer", "hello", "no tokenizer"),
    ("too long", list(range(MAX_LEN)), "max_model_len=40"),
]


@pytest.mark.parametrize("prompt, why", [(p, w) for _, p, w in BAD_PROMPTS], ids=[n for n, _, _ in BAD_PROMPTS])
def test_bad_prompts(busy, prompt, why):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match=why):
        busy.add_request(prompt)
    still_usable(busy, before)


def test_prompt_plus_new_tokens_beyond_max_model_len(busy):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match=r"\(30 tokens\) \+ max_new_tokens \(11\) = 41 exceeds max_model_len=40"):
        busy.add_request(list(range(30)), greedy(11))
    busy.add_request(list(range(30)), greedy(10))                        # exactly max_model_len is fine
    busy.abort(busy.requests[-1])
    assert state(busy)[1] == before[1]                                  # its blocks were never taken
    still_usable(busy, state(busy))


def test_generate_adds_none_when_one_prompt_is_bad(busy):
    before = state(busy)
    for bad in ([], [600], "text"):
        with pytest.raises(InvalidRequestError):
            busy.generate([GOOD, bad, GOOD], greedy(2), progress=False)
        assert state(busy) == before
    with pytest.raises(InvalidRequestError, match="3 prompts but 2 sampling"):
        busy.generate([GOOD] * 3, [greedy(2)] * 2, progress=False)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        busy.generate([GOOD, GOOD], [greedy(2), {"max_new_tokens": 0}], progress=False)
    still_usable(busy, before)


def test_decode_with_nothing_to_decode(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    for call in (sess.decode_step, sess.prefill, sess.step, sess.sample):
        with pytest.raises(InvalidRequestError, match="nothing to|no step"):
            call()
    sess.add_request(GOOD, greedy(2))
    before = state(sess)
    with pytest.raises(InvalidRequestError, match="nothing to decode: 1 waiting"):
        sess.decode_step()
    still_usable(sess, before)


def test_sampling_a_step_twice(busy):
    step = busy.decode_step()
    busy.sample(step)
    before = state(busy)
    with pytest.raises(InvalidRequestError, match=f"step {step.index} was already sampled"):
        busy.sample(step)
    with pytest.raises(InvalidRequestError, match="already sampled"):
        busy.sample()
    still_usable(busy, before)


def test_sampling_an_older_step_or_one_without_logits(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, chunk_size=4, max_model_len=MAX_LEN)
    sess.add_request(prompts((7,))[0], greedy(2))
    old = sess.prefill()
    assert old.logits is None
    with pytest.raises(InvalidRequestError, match="produced no logits"):
        sess.sample(old)
    sess.prefill()
    before = state(sess)
    with pytest.raises(InvalidRequestError, match="only the last step"):
        sess.sample(old)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        sess.sample(force=[512])
    with pytest.raises(InvalidRequestError, match="force has 2 tokens"):
        sess.sample(force=[1, 2])
    with pytest.raises(InvalidRequestError, match=r"force names requests \[99\]"):
        sess.sample(force={99: 1})
    assert state(sess) == before
    sess.sample()


def test_new_step_while_rows_are_unsampled(busy):
    step = busy.prefill()                                                # the waiting request completes
    assert step.logits is not None
    before = state(busy)
    calls = [busy.prefill, busy.decode_step, busy.step,
             lambda: busy.generate([GOOD], greedy(2), progress=False)]
    for call in calls:
        with pytest.raises(InvalidRequestError, match=f"step {step.index} .* unsampled rows.* sess.sample"):
            call()
        assert state(busy) == before
    busy.sample(step)
    still_usable(busy, state(busy))


def test_bad_request_handles(busy):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match="no request with id 99"):
        busy.request(99)
    with pytest.raises(InvalidRequestError, match="no request with id 99"):
        busy.abort(99)
    decoding = busy.requests[0]
    with pytest.raises(InvalidRequestError, match="cannot prefill request 0: it is decoding"):
        busy.prefill([decoding])
    assert state(busy) == before
    busy.abort(decoding)
    with pytest.raises(InvalidRequestError, match="already aborted"):
        busy.abort(decoding)
    still_usable(busy, state(busy))


def test_text_prompt_with_tokenizer(tiny_ckpt):
    sess = open_session(tiny_ckpt, max_batch=2)
    with pytest.raises(InvalidRequestError, match="empty"):
        sess.add_request("")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        sess.add_request([151936])
    req = sess.add_request("Hello there", greedy(2))
    assert req.prompt_token_ids == sess.tokenizer.encode("Hello there")
    assert isinstance(sess.generate("Hi", greedy(2), progress=False)[0].text, str)


@pytest.mark.parametrize("kw, why", [
    (dict(slot_check="loud"), "slot_check='loud'"),
    (dict(decode_padding="fixed"), "decode_padding='fixed'"),
    (dict(max_batch=0), "max_batch=0"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(chunk_size=2.5), "chunk_size=2.5"),
])
def test_bad_session_arguments(tiny_ckpt_small_vocab, kw, why):
    with pytest.raises(InvalidRequestError, match=why):
        Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", **kw)
