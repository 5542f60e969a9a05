"""``QWEN_NPU_CPU_ISA=avx2``: an AVX-512 machine runs the paths an AVX2-only one runs.

Checked in child processes, because the cap has to be in the environment before torch dispatches
its first kernel, as it is for a test run or a notebook kernel started with it.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from qwen_npu.kernels import cpu, cpu_features

PROBE = """
import json, os
import torch
import qwen_npu
from qwen_npu.kernels import cpu, cpu_features
x, w = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
routes = []
real = cpu.ops()
class Recorder:
    def __getattr__(self, name):
        routes.append(name)
        return getattr(real, name)
cpu.ops = lambda: Recorder()
cpu.linear(x, w)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "in_force": cpu_features.isa_cap_in_force(), "native_bf16": cpu_features.native_bf16(),
                  "bf16_dot": cpu.bf16_dot(), "routes": routes,
                  "flags": sorted(f for f in cpu_features.cpu_flags() if f.startswith(("avx512", "amx"))),
                  "env": {k: os.environ.get(k) for k in cpu_features.TORCH_ISA_CAPS}}))
"""


def probe(value):
    env = {k: v for k, v in os.environ.items() if k not in cpu_features.TORCH_ISA_CAPS}
    env.pop(cpu_features.ISA_ENV, None)
    if value is not None:
        env[cpu_features.ISA_ENV] = value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not cpu.available(), reason="the cpu kernel set cannot be built here")
def test_the_cap_turns_off_every_avx512_path():
    done = probe("avx2")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capability"] == "AVX2" and got["in_force"][0], got
    assert got["native_bf16"][0] is False and "QWEN_NPU_CPU_ISA=avx2" in got["native_bf16"][1]
    assert got["bf16_dot"] is False and got["flags"] == []
    assert got["routes"] == ["linear"]                      # the widening kernel, as on an AVX2-only CPU
    assert got["env"] == cpu_features.TORCH_ISA_CAPS       # handed on to torch and to child processes


@pytest.mark.skipif(not cpu.available(), reason="the cpu kernel set cannot be built here")
def test_without_the_cap_the_machine_answers_for_itself():
    done = probe(None)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["in_force"][0] and got["env"] == {k: None for k in cpu_features.TORCH_ISA_CAPS}
    if cpu_features.isa_cap() is None:                     # then this process answers for the machine too
        assert got["capability"] == torch.backends.cpu.get_cpu_capability()
        assert got["bf16_dot"] == cpu.bf16_dot()


def test_a_cap_set_too_late_is_reported_and_a_bad_value_refused(monkeypatch):
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    ok, why = cpu_features.isa_cap_in_force()
    assert ok == (torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"))
    if not ok:
        assert "set it before the process starts" in why
    monkeypatch.setenv(cpu_features.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="QWEN_NPU_CPU_ISA='sse2': expected one of native, avx2"):
        cpu_features.isa_cap()
