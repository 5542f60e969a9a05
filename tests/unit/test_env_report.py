"""env_report() and `qwen-npu env`: versions, devices and the kernel choice, ready to paste."""
import json
import sys

import torch

from qwen_npu import env_report
from qwen_npu.device import npu_status, resolve_kernels
from qwen_npu.device.npu_runtime import ATB_OPS, CUSTOM_OPS
from qwen_npu.tools.cli import main
from qwen_npu.tools.env import npu_attention_choice


def test_report_lists_versions_devices_and_session_choice():
    r = env_report().as_dict()
    assert r["torch"].startswith(torch.__version__)
    assert r["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    import transformers
    assert r["transformers"] == transformers.__version__
    assert "torch_npu" in r and "CANN" in r
    ok, reason = npu_status()
    if not ok:
        assert r["npu devices"] == reason
        cuda = torch.cuda.is_available()
        want = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        kernels = resolve_kernels("auto", want)
        assert f"device={want}, kernels={kernels}," in r["session default"]
        assert r["cpu kernels"].startswith("usable" if kernels == "cpu" else ("usable", "not usable"))
        if want.type == "cpu":                  # the set "auto" picks on this CPU, and why
            assert r["cpu auto choice"].startswith(f"{kernels}: ") and "bf16" in r["native bf16"]


def test_cann_version_is_read_from_the_toolkit_folder(tmp_path, monkeypatch):
    info = tmp_path / "x86_64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    r = env_report().as_dict()
    assert r["CANN"].startswith("8.0.RC3")
    assert f"ASCEND_TOOLKIT_HOME={tmp_path}" in r["environment"]


def test_cli_env_prints_text_and_json(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("qwen-npu environment") and "torch" in text and "session default" in text
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["torch"].startswith(torch.__version__)


def _support(**missing):
    return {op: missing.get(op) for op in (*CUSTOM_OPS, *ATB_OPS)}


FIA, ATB = "npu_fused_infer_attention_score", "_npu_paged_attention"


def _by_step(text):
    """{"all-fresh prefill": ..., "prefill chunks and mixed steps": ..., "decode": ..., ...}"""
    rest = text.split(": ", 1)[1]                              # after "block size N"
    return dict(p.split(": ", 1) for p in rest.split("; ") if ": " in p)


def test_npu_attention_choice_at_the_default_block_size_with_every_op():
    text = npu_attention_choice(_support())
    steps = _by_step(text)
    assert text.startswith("block size 128: ") and "for every step" not in text
    assert steps["all-fresh prefill"] == f"{FIA} (unpaged)"
    assert steps["prefill chunks and mixed steps"] == f"{FIA} (paged)"
    assert steps["decode"].startswith(f"{FIA} (paged), where that cannot: {ATB}")
    assert "head_dim % 16 == 0" in text and "65535" in text


def test_npu_attention_choice_at_a_block_size_paged_fia_cannot_take():
    steps = _by_step(npu_attention_choice(_support(), block_size=16))
    assert steps["all-fresh prefill"] == f"{FIA} (unpaged)"
    assert steps["prefill chunks and mixed steps"] == "the reference"
    assert steps["decode"].startswith(ATB)
    steps = _by_step(npu_attention_choice(_support(), block_size=8))      # not for ATB either
    assert steps["decode"] == "the reference"


def test_npu_attention_choice_without_fia_or_without_atb():
    text = npu_attention_choice(_support(**{FIA: "torch_npu 2.1 has no FIA"}))
    steps = _by_step(text)
    assert steps["all-fresh prefill"] == steps["prefill chunks and mixed steps"] == "the reference"
    assert steps["decode"].startswith(ATB) and "no FIA: torch_npu 2.1 has no FIA" in text
    text = npu_attention_choice(_support(**{ATB: "torch.ops.atb is not registered"}))
    assert _by_step(text)["decode"] == f"{FIA} (paged)" and "no ATB decode: torch.ops.atb" in text
    text = npu_attention_choice(_support(**{FIA: "none", ATB: "none", "npu_rms_norm": "none"}))
    assert _by_step(text)["decode"] == "the reference" and "reference kernels: npu_rms_norm" in text
    assert npu_attention_choice({}) == "- (torch_npu not loaded)"
