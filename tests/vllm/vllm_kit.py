"""Run tests/vllm/engine_run.py with the vLLM venv's python and collect its RESULT lines."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_engine(python, ckpt, scenarios, *, guard="count", scale=0.25, timeout=900, env=None):
    """Run engine_run.py; return {scenario: result dict} and the completed process."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_NPU_VLLM_GUARD")}
    e.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", **(env or {}))
    if guard:
        e["QWEN_NPU_VLLM_GUARD"] = guard
    proc = subprocess.run([python, str(HERE / "engine_run.py"), str(ckpt), ",".join(scenarios),
                           "--scale", str(scale), "--eager"], check=False, capture_output=True,
                          text=True, timeout=timeout, env=e)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["scenario"]] = r
    if not results:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
    return results, proc
