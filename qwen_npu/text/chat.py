"""Chat input: a list of messages rendered with the checkpoint's own chat template.

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        ──template (tokenizer_config.json "chat_template", jinja2)──>
    "<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"

The template is rendered by ``transformers``' own chat-template renderer (the sandboxed jinja2
environment behind ``tokenizer.apply_chat_template``; only that module is imported, when a chat
is first rendered), so the text — and hence the token ids — equal
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``. Template variables
such as ``enable_thinking`` pass through ``chat_template_kwargs``.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import InvalidRequestError


def is_messages(prompt) -> bool:
    """Does ``prompt`` look like a chat (a non-empty list of dicts) rather than text or token ids?"""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def template_kwargs(enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None) -> dict:
    """The variables handed to the template: ``chat_template_kwargs`` plus ``enable_thinking`` when set."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs must be a dict, "
                                  f"not {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = bool(enable_thinking)
    return kwargs


def apply_chat_template(tokenizer, messages, *, add_generation_prompt: bool = True, where: str = "",
                        **kwargs) -> str:
    """Render ``messages`` with ``tokenizer.chat_template``; InvalidRequestError when the
    checkpoint has none or the messages are malformed (``where`` names the checkpoint)."""
    _check_messages(messages)
    template = find_template(tokenizer)
    if not template:
        what = ("no tokenizer" if tokenizer is None else
                "no chat_template in tokenizer_config.json and no chat_template.jinja")
        raise InvalidRequestError(f"{where or 'this checkpoint'}: {what}, so chat messages cannot be used; "
                                  f"pass the prompt as text or token ids instead")
    if isinstance(template, list):        # a list of named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()))
    special = {k: _token_text(v) for k, v in tokenizer.config.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        rendered, _ = render_jinja_template([[dict(m) for m in messages]], chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**special, **kwargs})
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"{where or 'chat template'}: the chat template refused the "
                                  f"messages: {e}") from None
    return rendered[0]


def find_template(tokenizer) -> str | list | None:
    """The checkpoint's chat template: ``tokenizer_config.json`` "chat_template", else the
    ``chat_template.jinja`` file newer checkpoints ship; None when neither exists."""
    if tokenizer is None:
        return None
    if tokenizer.chat_template:
        return tokenizer.chat_template
    file = tokenizer.path / "chat_template.jinja"
    return file.read_text() if file.is_file() else None


def _check_messages(messages) -> None:
    if not is_messages(messages):
        raise InvalidRequestError("chat messages must be a non-empty list of dicts like "
                                  "{'role': 'user', 'content': '...'}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"chat message {i} must be a dict with a 'role' string, got {m!r}")
        if "content" in m and m["content"] is not None and not isinstance(m["content"], str):
            raise InvalidRequestError(f"chat message {i}: 'content' must be a string, "
                                      f"not {type(m['content']).__name__}")


def _token_text(v) -> str:
    return v.get("content", "") if isinstance(v, dict) else v
