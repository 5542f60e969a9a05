"""Chat input: messages are rendered with the checkpoint's own template, exactly as transformers does."""
import json
import shutil

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, 🦜 naïve"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def sess(tiny_ckpt):
    return Session.from_pretrained(tiny_ckpt, device="cpu", max_batch=4, num_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_prompt_equals_transformers_apply_chat_template(sess, hf_tokenizer, conv, thinking):
    messages = CONVERSATIONS[conv]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    req = sess.add_request(messages, SamplingParams(max_new_tokens=1), **kw)
    sess.abort(req)
    want = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert req.prompt_token_ids == list(want)
    assert req.prompt_text == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=True, **kw)
    if thinking is False:
        assert req.prompt_text.endswith("<think>\n\n</think>\n\n")


def test_chat_template_kwargs_pass_through(sess, hf_tokenizer):
    messages = CONVERSATIONS[0]
    req = sess.add_request(messages, chat_template_kwargs={"enable_thinking": False})
    sess.abort(req)
    assert req.prompt_text.endswith("<think>\n\n</think>\n\n")


def test_generate_takes_one_conversation_or_several(sess):
    one = sess.generate(CONVERSATIONS[0], SamplingParams(max_new_tokens=2), progress=False)
    both = sess.generate(CONVERSATIONS[:2], SamplingParams(max_new_tokens=2), progress=False)
    assert len(one) == 1 and len(both) == 2
    assert one[0].prompt_token_ids == both[0].prompt_token_ids
    assert one[0].token_ids == both[0].token_ids


def test_checkpoint_without_template_is_a_clear_error(tiny_ckpt, tmp_path):
    folder = shutil.copytree(tiny_ckpt, tmp_path / "no_template")
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    s = Session.from_pretrained(folder, device="cpu", max_batch=2, num_blocks=16, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="chat_template"):
        s.add_request(CONVERSATIONS[0])
    assert s.requests == []
    s.add_request("plain text still works")


def test_checkpoint_without_tokenizer_refuses_messages(tiny_ckpt_small_vocab):
    s = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", max_batch=2, num_blocks=16,
                                max_model_len=64)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        s.add_request(CONVERSATIONS[0])


@pytest.mark.parametrize("bad", [[{"content": "no role"}], [{"role": "user", "content": 3}]])
def test_malformed_messages_are_refused_before_any_state_changes(sess, bad):
    before = len(sess.requests)
    with pytest.raises(InvalidRequestError, match="chat message 0"):
        sess.add_request(bad)
    assert len(sess.requests) == before
