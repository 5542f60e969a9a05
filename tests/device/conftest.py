"""Tests in this folder need torch_npu importing and seeing an NPU. Elsewhere every one of them is
skipped with ONE reason, taken from ``qwen_npu.device.npu_status()`` (``pytest -rs`` prints it).

Run them on an Ascend host with:  python -m pytest tests/device -m device -rs
"""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(item.path).parents]
    if not mine:
        return
    from qwen_npu.device import npu_status
    available, reason = npu_status()
    if available:
        return
    skip = pytest.mark.skip(reason=f"NPU conformance tests need torch_npu and a visible NPU: {reason}")
    for item in mine:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def npu():
    """The NPU these tests run on."""
    from qwen_npu.device import resolve_device
    return resolve_device("npu")
