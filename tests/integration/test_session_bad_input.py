"""Bad input: each call fails with a clear InvalidRequestError before any state changes, and the
session stays usable (a normal generate still runs afterwards)."""
import math
import shutil

import pytest
import torch

from qwen_npu import CheckpointError, InvalidRequestError, SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3
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
    ("seed", -3), ("seed", 2**64), ("seed", True), ("seed", 1.0),
    ("temperature", 1e-38), ("temperature", 5e-6), ("temperature", True),
    ("max_new_tokens", True), ("top_k", True), ("min_new_tokens", True), ("logprobs", False),
    ("ignore_eos", "no"), ("ignore_eos", 1),
    ("stop_token_ids", ["a"]), ("stop_token_ids", ("a",)), ("stop_token_ids", 5), ("stop_token_ids", "5"),
    ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
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
    ("bytes", b"hello", "not bytes; decode bytes to str first"),
    ("set of ids", {1, 2, 3}, "list of int token ids .* not set"),
    ("dict", {1: 2}, "not dict"),
    ("2-D tensor", torch.tensor([[1, 2, 3]]), r"1-D token ids, not shape \[1, 3\]"),
    ("0-D tensor", torch.tensor(3), "1-D token ids"),
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
    (dict(block_size=0), "block_size=0 must be None .* or an int >= 1"),
    (dict(block_size=-4), "block_size=-4 must be"),
    (dict(max_model_len=0), "max_model_len=0 must be"),
    (dict(max_model_len=-1), "max_model_len=-1 must be"),
    (dict(num_blocks=0), "num_blocks=0 must be"),
    (dict(max_batch=True), "max_batch=True must be an int"),
    (dict(prefix_cache="no"), "prefix_cache='no' must be True or False"),
    (dict(deterministic=1), "deterministic=1 must be True or False"),
    (dict(device_outputs="0"), "device_outputs='0' must be True or False"),
    (dict(sync_timings=0), "sync_timings=0 must be True or False"),
    (dict(kernels="fast"), "kernels='fast' must be one of"),
    (dict(dtype="int8"), "dtype 'int8' is not supported"),
    (dict(kv_memory="lots"), "kv_memory='lots'"),
    (dict(num_blocks=8, kv_memory="1MiB"), "num_blocks or kv_memory, not both"),
])
def test_bad_session_arguments(tiny_ckpt_small_vocab, kw, why):
    with pytest.raises(InvalidRequestError, match=why):
        Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", **kw)


def test_a_session_option_refusal_reads_nothing(tmp_path):
    with pytest.raises(InvalidRequestError, match="block_size=0"):
        Session.from_pretrained(tmp_path / "no such folder", block_size=0)


def test_an_unknown_sampling_key_is_named_with_its_close_match(busy):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match="unknown SamplingParams field 'max_tokens'; did you mean 'max_new_tokens'"):
        busy.add_request(GOOD, {"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match="unknown SamplingParams field 'temprature'"):
        busy.generate([GOOD, GOOD], [greedy(2), {"temprature": 0.5}], progress=False)
    still_usable(busy, before)


def test_a_seed_too_large_for_a_generator_queues_nothing(busy):
    before = state(busy)
    sampled = SamplingParams(max_new_tokens=2, temperature=1.0, seed=2**64 - 1)     # the largest seed runs
    with pytest.raises(InvalidRequestError, match=r"seed=18446744073709551616: must be None or an int in \[0, 2\*\*64\)"):
        busy.generate([GOOD, GOOD], [sampled, {"temperature": 1.0, "seed": 2**64}], progress=False)
    still_usable(busy, before)
    assert len(busy.generate([GOOD], sampled, progress=False)[0].token_ids) == 2


@pytest.mark.parametrize("prompts_arg, why", [({1, 2, 3}, "not set"), (b"hi", "not bytes"), (7, "not int"),
                                              (None, "not NoneType")])
def test_generate_refuses_what_is_no_prompt_nor_a_list_of_them(busy, prompts_arg, why):
    before = state(busy)
    with pytest.raises(InvalidRequestError, match=why):
        busy.generate(prompts_arg, greedy(2), progress=False)
    still_usable(busy, before)


def edited_copy(src, dst, file="config.json", **fields):
    """A copy of checkpoint ``src`` with ``fields`` set in its JSON ``file``."""
    import json
    shutil.copytree(src, dst)
    d = json.loads((dst / file).read_text())
    d.update(fields)
    (dst / file).write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("fields, why", [
    (dict(num_hidden_layers=-1), "field 'num_hidden_layers' is -1; it must be an int >= 1"),
    (dict(num_hidden_layers=0), "field 'num_hidden_layers' is 0"),
    (dict(hidden_size="abc"), "field 'hidden_size' is 'abc'; it must be an int >= 1"),
    (dict(vocab_size=512.5), "field 'vocab_size' is 512.5"),
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(rms_norm_eps="tiny"), "field 'rms_norm_eps' is 'tiny'"),
    (dict(tie_word_embeddings="yes"), "field 'tie_word_embeddings' is 'yes'"),
])
def test_a_bad_config_field_is_a_checkpoint_error_naming_file_and_field(tiny_ckpt_small_vocab, tmp_path, fields, why):
    ckpt = edited_copy(tiny_ckpt_small_vocab, tmp_path / "ckpt", **fields)
    with pytest.raises(CheckpointError, match="config.json: " + why):
        Session.from_pretrained(ckpt, device="cpu")


def test_a_bad_generation_config_eos_names_that_file(tiny_ckpt_small_vocab, tmp_path):
    ckpt = edited_copy(tiny_ckpt_small_vocab, tmp_path / "ckpt", "generation_config.json", eos_token_id="end")
    with pytest.raises(CheckpointError, match="generation_config.json: field 'eos_token_id' is 'end'"):
        Session.from_pretrained(ckpt, device="cpu")


def test_weights_of_more_layers_than_the_config_says_are_refused(tmp_path):
    ckpt = make_tiny_qwen3(tmp_path / "four", vocab_size=512, num_hidden_layers=4)
    edited = edited_copy(ckpt, tmp_path / "two", num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"model.safetensors: holds tensors of layers 2..3 .*"
                                              r"num_hidden_layers=2"):
        Session.from_pretrained(edited, device="cpu")


@pytest.mark.parametrize("file, text, why", [
    ("tokenizer.json", "{not json", "tokenizer.json: not a readable tokenizer file"),
    ("tokenizer.json", '{"version": "1.0"}', "tokenizer.json: not a readable tokenizer file"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: must hold a JSON object"),
    ("tokenizer_config.json", '{"chat_template": 5}', "tokenizer_config.json: field 'chat_template' must be"),
])
def test_a_corrupt_tokenizer_file_is_a_checkpoint_error_naming_it(tiny_ckpt, tmp_path, file, text, why):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / file).write_text(text)
    with pytest.raises(CheckpointError, match=why):
        Session.from_pretrained(ckpt, device="cpu")


def test_a_refused_generate_on_a_fork_leaves_it_as_it_was(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, block_size=4, num_blocks=6, max_model_len=32, chunk_size=8)
    held = sess.add_request(list(range(1, 18)), greedy(6))   # 17 + 6 tokens: 6 blocks, all of the cache
    while held.status != "decoding":
        sess.step()
    child = sess.fork()
    for r in child.requests:
        child.abort(r)
    before, digest = state(child), child.state_digest()
    with pytest.raises(InvalidRequestError, match=f"other branches of this fork hold: request {held.id}"):
        child.generate([list(range(30, 40)), list(range(40, 45))], greedy(4), progress=False)
    assert state(child) == before and child.state_digest() == digest
    assert not [r for r in child.requests if not r.is_done]
    while not held.is_done:
        sess.step()
    (done,) = child.generate([list(range(30, 40))], greedy(4), progress=False)
    assert len(done.token_ids) == 4 and [r.id for r in child.requests if r.status == "waiting"] == []


@pytest.mark.skipif(not __import__("qwen_npu.kernels.cpu", fromlist=["available"]).available(),
                    reason="the cpu kernel set cannot be built here")
def test_float16_with_the_cpu_set_is_refused_at_load_and_auto_takes_the_reference_set(tiny_ckpt_small_vocab):
    with pytest.raises(InvalidRequestError, match="kernels='cpu' runs bfloat16 and float32 models, not torch.float16"):
        Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", kernels="cpu", dtype="float16")
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", kernels="auto", dtype="float16")
    assert sess.config.kernels == "reference" and sess.model.dtype == torch.float16
    out = sess.generate([prompts([4])[0]], greedy(2), progress=False)
    assert len(out[0].token_ids) == 2
