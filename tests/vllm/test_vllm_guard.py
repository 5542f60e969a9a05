"""The slot guard inside vLLM 0.32's CPU build: clean workloads stay silent, injected faults are caught.

One engine (a tiny Qwen3, eager mode, the guard in count mode) serves, in turn: the `mixed` and
`seed` workloads (`mixed` scaled to a quarter: 8 requests of 16..128-token prompts and 8..32 new
tokens; `seed` full size: 16 copies of a 512-token prompt, 64 new tokens each, so the rows share
prefix blocks), then one small run per injected fault, and last one fault with the guard switched
to raise.
"""
import re

import pytest
from vllm_kit import run_engine

FAULTS = {   # fault -> the check that must name the injected request ids
    "copy_row0": "duplicate",          # row 0's slot copied into another row (replicate padding)
    "off_by_one": "wrong_slot",
    "past_blocks": "outside_blocks",   # a position past the row's allocated blocks
    "padding_slot0": "padding_write",  # a padded tail token carrying slot 0 instead of -1
    "shared_block": "shared_block",    # a write into a prefix block another live row holds
}
SCENARIOS = ["mixed", "seed@1", *FAULTS, "raise:copy_row0"]


@pytest.fixture(scope="module")
def engine(vllm_python, vllm_ckpt):
    results, proc = run_engine(vllm_python, vllm_ckpt, SCENARIOS)
    assert results, f"engine_run printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.parametrize("workload", ["mixed", "seed"])
def test_shared_workloads_run_with_zero_reports(engine, workload):
    r = engine[workload]
    if workload == "seed":
        assert r["steps_sharing_blocks"] >= 10       # prefix blocks shared by live rows, never written
    assert r["error"] is None
    first, last = r["steps"]
    assert last - first >= 10                  # the guard really checked this run's steps
    assert r["reports"] == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_injected_fault_is_caught_in_its_step_with_its_request_ids(engine, fault):
    r = engine[fault]
    assert r["error"] is None
    injected = r["injected"]
    assert injected is not None, f"{fault}: the run never reached a step where the fault applies"
    (report,) = [x for x in r["reports"] if x["step"] == injected["step"]]
    assert not report["late"]
    named = [p for p in report["problems"] if p["check"] == FAULTS[fault]]
    assert named, report["problems"]
    assert named[0]["request_ids"] == injected["request_ids"]
    assert all(x["step"] == injected["step"] for x in r["reports"])    # and in no other step
    for p in report["problems"]:
        assert p["message"].startswith(f"step {injected['step']} ")


def test_raise_mode_stops_the_bad_step_with_a_slot_collision_error(engine):
    r = engine["raise:copy_row0"]
    rid = r["injected"]["request_ids"]
    assert "SlotCollisionError" in r["error"]
    assert f"rows 0, 3 (requests {rid[0]}, {rid[1]}) both write slot" in r["error"] or \
        all(x in r["error"] for x in rid)


def test_without_the_environment_variable_the_plugin_does_nothing(vllm_python, vllm_ckpt):
    results, _ = run_engine(vllm_python, vllm_ckpt, ["copy_row0"], guard=None)
    r = results["copy_row0"]
    assert r["steps"] is None and r["reports"] is None     # no guard was created
    assert r["injected"] is not None and r["error"] is None  # the fault ran, unreported


def test_vllm_loads_the_plugin_itself_in_its_engine_process(vllm_python, vllm_ckpt):
    """Default multiprocessing: the engine core is a spawned process that loads the entry point."""
    results, proc = run_engine(vllm_python, vllm_ckpt, ["mixed"], scale=0.1,
                               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert results["mixed"]["error"] is None
    assert results["mixed"]["steps"] == [0, 0]          # this process only launched the engine
    err = proc.stderr
    assert "qwen_npu slot guard: checking every step of CPUModelRunner before its forward" in err
    m = re.search(r"qwen_npu slot guard: (\d+) steps checked in [\d.]+ s, no problems", err)
    assert m and int(m.group(1)) >= 10, err[-3000:]
