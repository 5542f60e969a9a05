"""env_report() and `qwen-npu env`: versions, devices and the kernel choice, ready to paste."""
import json
import sys

import torch

from qwen_npu import env_report
from qwen_npu.tools.cli import main
from qwen_npu.device import npu_status, resolve_kernels


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
