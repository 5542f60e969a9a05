"""Stop strings, min_new_tokens and what finish_reason / stop_reason report."""
import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session

EOS = 511


@pytest.fixture(scope="module")
def text_sess(tiny_ckpt):
    return Session.from_pretrained(tiny_ckpt, device="cpu", max_batch=4, block_size=8, num_blocks=64,
                                   max_model_len=256)


@pytest.fixture
def ids_sess(tiny_ckpt_small_vocab):
    return Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", max_batch=4, block_size=4,
                                   num_blocks=64, max_model_len=96)


def run(sess, prompt, **kw):
    return sess.generate(prompt, SamplingParams(ignore_eos=True, **kw), progress=False)[0]


def test_stop_string_is_cut_from_the_text_and_named(text_sess):
    full = run(text_sess, "hello", max_new_tokens=6)
    assert full.finish_reason == "length" and full.stop_reason is None
    stop = full.text[3:12]
    out = run(text_sess, "hello", max_new_tokens=6, stop=stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:3]
    # the tokens that spelled the stop string stay: exactly those up to the one completing it
    n = next(k for k in range(1, 7) if stop in text_sess.tokenizer.decode(full.token_ids[:k]))
    assert out.token_ids == full.token_ids[:n]


def test_the_stop_string_that_starts_first_wins(text_sess):
    full = run(text_sess, "hello", max_new_tokens=6).text
    late, early = full[5:9], full[2:5]             # both completed by the first token
    assert full.find(late) > full.find(early)
    out = run(text_sess, "hello", max_new_tokens=6, stop=[late, early, "not there"])
    assert out.stop_reason == early and out.text == full[:2]


def test_min_new_tokens_delays_a_stop_string(text_sess):
    full = run(text_sess, "hello", max_new_tokens=6)
    per_token = [text_sess.tokenizer.decode([t]) for t in full.token_ids]
    stop = per_token[0]                      # completed by the very first token
    out = run(text_sess, "hello", max_new_tokens=6, stop=stop, min_new_tokens=1)
    # the first occurrence came too early; the next one (token 2) stops it
    assert out.finish_reason == "stop" and len(out.token_ids) == 2
    assert out.text == per_token[0]


def test_eos_reports_its_token_id(ids_sess):
    req = ids_sess.add_request([5, 6, 7], SamplingParams(max_new_tokens=8))
    ids_sess.sample(ids_sess.prefill(), force={req.id: EOS})
    assert req.finish_reason == "stop" and req.stop_reason == EOS


def test_forced_eos_before_min_new_tokens_does_not_stop(ids_sess):
    req = ids_sess.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, min_new_tokens=2))
    ids_sess.sample(ids_sess.prefill(), force={req.id: EOS})
    ids_sess.sample(ids_sess.decode_step(), force={req.id: EOS})
    assert req.status == "decoding"
    ids_sess.sample(ids_sess.decode_step(), force={req.id: EOS})
    assert req.status == "finished" and req.stop_reason == EOS and req.output_token_ids == [EOS] * 3


def test_min_new_tokens_masks_stop_ids_in_the_sampler(ids_sess):
    first = run(ids_sess, [1, 2, 3, 4], max_new_tokens=4)
    t0 = first.token_ids[0]
    stopped = ids_sess.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, stop_token_ids=[t0]),
                                progress=False)[0]
    assert stopped.token_ids == (t0,) and stopped.stop_reason == t0
    held = ids_sess.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, stop_token_ids=[t0],
                                                          min_new_tokens=3), progress=False)[0]
    assert t0 not in held.token_ids[:3] and len(held.token_ids) >= 3
    # the step's logits themselves are untouched: the mask lives in a copy
    step = ids_sess.history[-1]
    assert step.logits is not None and bool((step.logits.tensor > float("-inf")).all())


@pytest.mark.parametrize("kw, field", [
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"), ({"stop": ""}, "stop"),
    ({"stop": ["a", 3]}, "stop"), ({"stop": 3}, "stop"), ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_sampling_params_are_refused(kw, field):
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_checkpoint_dependent_checks_refuse_before_any_state_changes(ids_sess):
    for sp, what in ((SamplingParams(stop="x"), "no tokenizer"),
                     (SamplingParams(stop_token_ids=[600]), "vocabulary"),
                     (SamplingParams(logprobs=513), "vocabulary")):
        with pytest.raises(InvalidRequestError, match=what):
            ids_sess.add_request([1, 2], sp)
    assert ids_sess.requests == []


def test_sampling_params_stay_backward_compatible():
    sp = SamplingParams(8, 0.5, 3, 0.9, 7, [1, 2], True)
    assert (sp.max_new_tokens, sp.top_k, sp.stop_token_ids, sp.ignore_eos) == (8, 3, (1, 2), True)
    assert sp.stop is None and sp.min_new_tokens == 0 and sp.logprobs is None
    assert SamplingParams(stop="ab").stop == ("ab",)
