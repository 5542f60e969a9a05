"""chat.apply_chat_template renders with transformers' chat-template renderer: special tokens
from tokenizer_config.json and template variables reach the template, and a template that
refuses the messages is an InvalidRequestError naming the checkpoint."""
import types
from pathlib import Path

import pytest

from qwen_npu import InvalidRequestError
from qwen_npu.text.chat import apply_chat_template

TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant{% if enable_thinking is defined and not enable_thinking %}"
            " (no thinking){% endif %}:{% endif %}"
            "{% if messages | length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}")


def fake_tokenizer(template=TEMPLATE):
    return types.SimpleNamespace(chat_template=template, path=Path("/nonexistent"),
                                 config={"bos_token": {"content": "<s>"}, "eos_token": "</s>"})


def test_special_tokens_and_variables_reach_the_template():
    msgs = [{"role": "user", "content": "grüße"}]
    assert apply_chat_template(fake_tokenizer(), msgs) == '<s>user: "grüße"\nassistant:'
    assert apply_chat_template(fake_tokenizer(), msgs, enable_thinking=False).endswith("assistant (no thinking):")
    assert apply_chat_template(fake_tokenizer(), msgs, add_generation_prompt=False) == '<s>user: "grüße"\n'


def test_a_template_that_refuses_is_a_clear_error():
    msgs = [{"role": "user", "content": str(i)} for i in range(3)]
    with pytest.raises(InvalidRequestError, match="ckpt: the chat template refused the messages: at most two"):
        apply_chat_template(fake_tokenizer(), msgs, where="ckpt")
