"""``qwen-npu``: a subcommand whose module fails to import is listed with the error, and running
it prints the error and exits 1; the other subcommands still work."""
import sys

import pytest

from qwen_npu.tools import cli


def test_every_subcommand_is_listed(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "inspect", "env", "build-kernels"):
        assert command in out
    assert "UNAVAILABLE" not in out


def test_a_subcommand_that_fails_to_import_says_why(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "qwen_npu.tools.bench", raising=False)
    monkeypatch.setitem(sys.modules, "qwen_npu.tools.bench", None)       # import now raises ImportError
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "bench" in out and "UNAVAILABLE (qwen_npu.tools.bench failed to import" in " ".join(out.split())
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "qwen_npu.tools.bench failed to import: ModuleNotFoundError: import of qwen_npu.tools.bench halted" in err
    assert cli.main(["env", "--json"]) == 0                          # the others still run
    assert '"qwen_npu"' in capsys.readouterr().out
