"""The plug point through which inspect and research lend the lower layers their views and
Session methods."""
import pytest

import qwen_npu  # noqa: F401  registers every implementation
from qwen_npu import extensions


def test_every_name_the_lower_layers_call_is_provided():
    names = ["take_request", "take_step", "logits_html", "request_text", "request_html", "step_text",
             "step_html", "session_text", "session_html", "session.snapshot", "session.state_digest",
             "session.blocks", "session.kv", "session.check", "session.audit", "session.capture",
             "session.intervene", "session.attention", "slot_report_html", "memory_report_html",
             "kv_html", "slot_info_html", "check_html", "audit_html", "blocks_text", "blocks_html",
             "slot_detail_text", "slot_detail_html", "topk_text", "topk_html", "closed_session_html"]
    missing = [n for n in names if n not in extensions._IMPLEMENTATIONS]
    assert missing == []
    from qwen_npu.inspect.snapshot import take_step
    assert extensions.implementation("take_step") is take_step


def test_a_missing_name_says_what_to_import():
    with pytest.raises(LookupError, match="nothing provides 'no.such.thing'.*import qwen_npu"):
        extensions.implementation("no.such.thing")


def test_a_second_provider_of_a_name_is_refused(monkeypatch):
    monkeypatch.setattr(extensions, "_IMPLEMENTATIONS", dict(extensions._IMPLEMENTATIONS))

    def take_step(step):                       # a different function under a taken name
        return step
    with pytest.raises(ValueError, match="'take_step' is already provided by qwen_npu.inspect.snapshot"):
        extensions.provides("take_step")(lambda s: s)
    extensions.provides("mine")(take_step)
    assert extensions.implementation("mine") is take_step


def test_the_old_fork_module_still_works_and_says_where_it_moved():
    import importlib
    import sys

    sys.modules.pop("qwen_npu.research.fork", None)
    with pytest.warns(DeprecationWarning, match="qwen_npu.research.fork moved to qwen_npu.session_fork"):
        old = importlib.import_module("qwen_npu.research.fork")
    from qwen_npu import session_fork
    assert old.fork_session is session_fork.fork_session and old.Branches is session_fork.Branches
