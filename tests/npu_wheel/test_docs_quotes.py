"""Every quotation of the wheel in docs/npu.md is still in the wheel, where the doc says it is.

A quotation is a line ``> `<file in the wheel>` · `<op or function>`: 「<verbatim text>」``. For
the op docstrings the text must be in that op's docstring; for a header, in that op's
declaration; for a meta registration, in that op's function; for a compiled library, anywhere in
its strings.
"""
from __future__ import annotations

import re

import pytest
from wheel_kit import ROOT

DOC = ROOT / "docs" / "npu.md"
QUOTE = re.compile(r"^> `(?P<file>[^`]+)` · `(?P<scope>[^`]+)`: 「(?P<text>[^」]+)」\s*$", re.MULTILINE)


def quotations():
    return [m.groupdict() for m in QUOTE.finditer(DOC.read_text())]


def scoped(wheel, file, scope) -> str:
    """The part of ``file`` the quotation must come from."""
    if file.endswith(".so"):
        return wheel.read_bytes(file).decode("latin-1")
    text = wheel.read_text(file).replace("\r\n", "\n")
    if file.endswith("_op_plugin_docs.py"):           # _add_torch_npu_docstr("op", """...""")
        start = text.index(f'_add_torch_npu_docstr(\n    "{scope}",')
        end = text.find("_add_torch_npu_docstr(", start + 1)
        return text[start:end if end > 0 else None]
    if file.endswith(".h"):
        return "\n".join(line for line in text.splitlines() if re.search(rf"\b{re.escape(scope)}\(", line))
    raise AssertionError(f"docs/npu.md quotes {file}, which this check cannot scope")


def test_the_doc_quotes_the_wheel():
    found = quotations()
    assert len(found) >= 15, found
    files = {q["file"] for q in found}
    assert {"torch_npu/_op_plugin_docs.py", "torch_npu/lib/libop_plugin_atb.so"} <= files


@pytest.mark.parametrize("q", quotations(), ids=lambda q: f"{q['scope']}:{q['text'][:24]}")
def test_each_quotation_is_in_the_wheel_where_the_doc_says(wheel, q):
    assert q["file"] in wheel.names, f"torch-npu {wheel.version} has no {q['file']}"
    assert q["text"] in scoped(wheel, q["file"], q["scope"]), (
        f"docs/npu.md quotes {q['file']} ({q['scope']}) but torch-npu {wheel.version} does not say: {q['text']}")


def test_a_misattributed_quotation_is_caught(wheel):
    text = "sparse_mode为3时, 代表rightDownCausal模式的mask"
    assert text in scoped(wheel, "torch_npu/_op_plugin_docs.py", "npu_fused_infer_attention_score")
    assert text not in scoped(wheel, "torch_npu/_op_plugin_docs.py", "npu_rms_norm")
