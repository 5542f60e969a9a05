"""sess.stream(): per-request text increments whose concatenation is the final text."""
import pytest

from qwen_npu import SamplingParams, Session
from qwen_npu.session.streaming import TextIncrements

# byte-level tokens that split characters: "🦜" = [123918, 250], "🫠" = [9284, 104, 254]
FORCED = [108386, 123918, 250, 99489, 9284, 104, 254, 220, 123918, 250, 13]   # 你好🦜世界🫠 🦜.


@pytest.fixture
def sess(tiny_ckpt):
    return Session.from_pretrained(tiny_ckpt, device="cpu", max_batch=4, block_size=8, num_blocks=64,
                                   max_model_len=256)


def test_forced_multibyte_output_is_never_split(sess):
    """Teacher-force tokens that split emoji; poll the stream's text after every step."""
    req = sess.add_request("Say it:", SamplingParams(max_new_tokens=len(FORCED), ignore_eos=True))
    other = sess.add_request("Another stream", SamplingParams(max_new_tokens=len(FORCED), ignore_eos=True))
    inc = TextIncrements(req, sess.tokenizer.decode)
    events = []
    for tok in FORCED:
        step = sess.prefill() if req.status in ("waiting", "prefilling") else sess.decode_step()
        sess.sample(step, force={req.id: tok})
        events.append(inc.poll(0))
    texts = [e.text for e in events]
    assert texts == ["你好", "", "🦜", "世界", "", "", "🫠", " ", "", "🦜", "."]
    assert "".join(texts) == req.text == "你好🦜世界🫠 🦜."
    assert events[-1].finish_reason == "length" and events[-1].token_ids == (13,)
    assert other.status == "finished"


def test_stream_concatenation_equals_final_text(sess):
    # "龘" makes this tied model emit lone continuation bytes, then a 3-byte character
    prompts = ["龘", "hello", "🦜 and 你好"]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    got = {i: "" for i in range(len(prompts))}
    ids = {i: [] for i in range(len(prompts))}
    finish = {}
    for ev in sess.stream(prompts, sampling):
        assert ev.index not in finish, "no event after a request's last one"
        got[ev.index] += ev.text
        ids[ev.index] += ev.token_ids
        if ev.finished:
            finish[ev.index] = ev.finish_reason
    reqs = sess.requests[-len(prompts):]
    for i, req in enumerate(reqs):
        assert got[i] == req.text and ids[i] == req.output_token_ids and finish[i] == "length"
    assert any(ord(c) > 0x7FF for c in "".join(got.values())), "the outputs include multi-byte characters"


def test_stream_holds_back_a_possible_stop_string(sess):
    full = sess.generate("hello", SamplingParams(max_new_tokens=6, ignore_eos=True), progress=False)[0].text
    stop = full[3:12]                                # spans a token boundary of the repeated output
    events = list(sess.stream("hello", SamplingParams(max_new_tokens=6, ignore_eos=True, stop=stop)))
    assert "".join(e.text for e in events) == full[:3] == sess.requests[-1].text
    assert events[-1].finish_reason == "stop" and sess.requests[-1].stop_reason == stop


def test_breaking_out_of_a_stream_aborts_its_requests(sess):
    events = sess.stream(["a", "b"], SamplingParams(max_new_tokens=10, ignore_eos=True))
    next(events)
    events.close()
    assert [r.status for r in sess.requests] == ["aborted", "aborted"]
    sess.generate("still usable", SamplingParams(max_new_tokens=2), progress=False)


def test_stream_without_tokenizer_yields_token_ids(tiny_ckpt_small_vocab):
    s = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", max_batch=2, num_blocks=32,
                                max_model_len=64)
    events = list(s.stream([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert [t for e in events for t in e.token_ids] == s.requests[0].output_token_ids
    assert all(e.text == "" for e in events) and events[-1].finished
