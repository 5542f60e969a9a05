"""A Session split over 2 CPU processes (gloo) against the same model on one: the same logits
within float32 rounding, the same greedy tokens, every rank's K/V gathered, hook points whole, and
every failure -- a rank holding another plan, a fault on rank 1, Ctrl-C on rank 0, a killed
worker -- leaving both ranks as they were or reported by rank.

TP=2 and TP=1 are not bitwise equal: rank 0 and rank 1 each sum half of every o_proj and
down_proj product and the all-reduce adds the halves, another order of the same sums. Logits
agree within 1e-4 absolute (float32), K/V within 1e-5.
"""
import os
import signal
import time

import pytest
import torch

import qwen_npu
import qwen_npu.parallel
from qwen_npu import InvalidRequestError, SamplingParams
from qwen_npu.engine.transaction import inject_faults
from qwen_npu.inspect.digest import state_digest
from qwen_npu.parallel import TensorParallelError, inject_rank_fault
from qwen_npu.research import DLA_NAMES, direct_logit_attribution, zero_heads
from qwen_npu.testing import make_tiny_qwen3, tiny_trained_qwen3

SETTINGS = dict(kernels="reference", dtype="float32", block_size=4, num_blocks=24, max_batch=4, chunk_size=16)
PROMPTS = ["a small tree of the genus", "music means", "the study of", "a river in the north of"]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
TIMEOUT_S = 30     # every wait on the other ranks, in this file: a wait that ran into it took this long
POINTS = ("planned", "validated", "dispatched", "booked", "sampled", "d2h", "staged", "commit")


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("QWEN_NPU_TP_TIMEOUT_S", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def pair():
    os.environ.setdefault("QWEN_NPU_TP_TIMEOUT_S", str(TIMEOUT_S))
    one = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), **SETTINGS)
    two = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    yield one, two
    two.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def prefill_both(one, two, prompt, new=6):
    for s in (one, two):
        s.reset()
        r = s.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        while r.num_computed_tokens < len(r.prompt_token_ids):
            step = s.step()
    return step


def test_a_held_out_shape_agrees_too(tmp_path):
    path = make_tiny_qwen3(tmp_path / "wide", seed=3, hidden_size=96, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=12, intermediate_size=160, vocab_size=300)
    one = qwen_npu.Session.from_pretrained(path, **SETTINGS)
    two = qwen_npu.Session.from_pretrained(path, tensor_parallel_size=2, **SETTINGS)
    try:
        prompts = [[5, 17, 42, 99, 7, 3, 250, 11, 64], [8, 8, 1, 200]]
        a = one.generate(prompts, GREEDY, progress=False)
        b = two.generate(prompts, GREEDY, progress=False)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for s in (one, two):
            s.add_request(prompts[0], SamplingParams(max_new_tokens=2))
        assert (one.step().logits.tensor - two.step().logits.tensor).abs().max() <= 1e-4
        assert two.kv.head_ranks == [range(0, 2), range(2, 4)]
    finally:
        two.close()


def test_two_ranks_give_tp1_logits_and_greedy_tokens(pair):
    one, two = pair
    one.reset(), two.reset()
    a = one.generate(PROMPTS, GREEDY, progress=False)
    b = two.generate(PROMPTS, GREEDY, progress=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for s in (one, two):
        s.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3))
    la, lb = one.step().logits.tensor, two.step().logits.tensor
    assert (la - lb).abs().max() <= 1e-4
    assert two.model_config == one.model_config and two.model_config.num_key_value_heads == 2
    assert two.model.config.num_key_value_heads == 1            # rank 0's shard
    assert "tensor_parallel_size=2 (1 KV head per rank)" in repr(two)


def test_gathered_kv_is_tp1s(pair):
    one, two = pair
    prefill_both(one, two, PROMPTS[3])
    n = one.requests[0].num_computed_tokens
    for layer in range(4):
        for p in range(n):
            k1, v1 = one.kv.read(0, p, layer)
            k2, v2 = two.kv.read(0, p, layer)
            assert k2.shape == k1.shape == (2, 48)
            assert (k1 - k2).abs().max() <= 1e-5 and (v1 - v2).abs().max() <= 1e-5
    slots = [one.kv.slot_of(0, p) for p in range(n)]
    assert slots == [two.kv.slot_of(0, p) for p in range(n)]           # every rank holds the same block ids
    whole = two.kv.key(2)
    assert whole.shape == one.kv.key(2).shape
    flat1, flat2 = one.kv.key(2).flatten(0, 1)[slots], whole.flatten(0, 1)[slots]
    assert (flat1 - flat2).abs().max() <= 1e-5
    assert "KV heads 0..0 on rank 0, 1..1 on rank 1" in repr(two.kv)
    report = two.audit(0)
    assert report.ok and report.num_tokens == n
    assert two.check().ok
    from qwen_npu.inspect.slot_detail import inspect_slot
    assert inspect_slot(two, slots[2]).k_norms == pytest.approx(inspect_slot(one, slots[2]).k_norms, abs=1e-3)


def test_captures_and_interventions_see_the_whole_tensors(pair):
    one, two = pair
    prefill_both(one, two, PROMPTS[0])
    names = ["layers.1.attn.q", "layers.1.attn.k", "layers.1.mlp.act", "layers.2.attn.scores", "layers.3.residual",
             "final_norm", "logits"]
    caps = []
    for s in (one, two):
        with s.capture(names) as cap:
            s.step()
        caps.append(cap)
    for name in names:
        a, b = caps[0].stack(name, 0), caps[1].stack(name, 0)
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-4, name
    out = []
    for s in (one, two):
        with s.intervene("layers.1.attn.z", zero_heads(3)), s.intervene("logits", lambda x: x * 2):
            out.append(s.step())                                 # head 3 lives on rank 1
    assert (out[0].logits.tensor - out[1].logits.tensor).abs().max() <= 2e-4
    out = []
    for s in (one, two):
        with s.intervene("layers.1.attn.z", zero_heads(3)):
            out.append(s.step())
    assert (out[0].logits.tensor - out[1].logits.tensor).abs().max() <= 1e-4


def test_a_rank_holding_another_plan_is_refused_before_any_write(pair):
    one, two = pair
    prefill_both(one, two, PROMPTS[1])
    before = state_digest(two, kv=True)
    inject_rank_fault(two, "corrupt_plan")
    with pytest.raises(TensorParallelError, match=r"step \d+ refused before any rank wrote K/V: .*rank 1's "
                                                  r"slot_mapping differs at entry 0"):
        two.step()
    assert state_digest(two, kv=True) == before
    assert two.step().kind == "decode"                            # the next step runs


def test_a_fault_on_rank_1_leaves_both_ranks_as_they_were(pair):
    """Faulted steps that evict cached prefix blocks: rank 1 puts back the bytes it overwrote."""
    one, two = pair
    two.reset()
    two.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6, ignore_eos=True), progress=False)
    manager = two._engine.manager
    assert manager.num_cached_blocks
    two.add_request("the dog", SamplingParams(max_new_tokens=90, ignore_eos=True))
    while manager.num_free_blocks > manager.num_cached_blocks:      # uncached free blocks first
        two.step()
    evicted = False
    for _ in range(6):
        before, cached = state_digest(two, kv=True), manager.num_cached_blocks
        inject_rank_fault(two, "fail_after_forward")
        with pytest.raises(TensorParallelError, match="failed on rank 1: .*injected fault after the forward.*"
                                                      "nothing was committed"):
            two.step()
        assert state_digest(two, kv=True) == before
        two.step()
        evicted |= manager.num_cached_blocks < cached
    assert evicted, "no faulted step took a cached block"


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_at_any_point_of_a_step_rolls_back_every_rank(pair, point):
    one, two = pair
    prefill_both(one, two, PROMPTS[2])
    two.step()
    before = state_digest(two, kv=True)

    def fire(name):
        if name == point:
            raise KeyboardInterrupt

    with inject_faults(fire), pytest.raises(KeyboardInterrupt):
        two.step()
    assert state_digest(two, kv=True) == before, point
    assert two.step().kind == "decode" and two.check().ok


def test_a_real_ctrl_c_during_the_forward_lands_after_every_rank_finished(pair):
    """SIGINT while rank 0 is inside its forward: held back, the step rolls back on both ranks."""
    one, two = pair
    prefill_both(one, two, PROMPTS[2])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = state_digest(two, kv=True)
        with two.intervene("layers.1.mlp.out", lambda x: os.kill(os.getpid(), signal.SIGINT) or None):
            with pytest.raises(KeyboardInterrupt):
                two.step()
        assert state_digest(two, kv=True) == before
    finally:
        signal.signal(signal.SIGINT, previous)
    assert two.step().kind == "decode"


def test_what_needs_one_rank_is_refused_with_the_remedy(pair, tmp_path):
    one, two = pair
    prefill_both(one, two, PROMPTS[0])
    with pytest.raises(TensorParallelError, match="fork is not available with tensor_parallel_size=2"):
        two.fork()
    with pytest.raises(TensorParallelError, match="capture 'layers.1.attn.scores'"):
        two.attention(0, 1)
    with pytest.raises(InvalidRequestError, match="emulate_faults is not available with tensor_parallel_size=2"):
        two.emulate_faults("zeros")
    req = two.requests[0]
    with two.capture(list(DLA_NAMES)) as cap:
        two.step()
    with pytest.raises(TensorParallelError, match="direct_logit_attribution"):
        direct_logit_attribution(two, cap, req, 1, 2)
    with pytest.raises(InvalidRequestError, match="does not divide the model's num_key_value_heads"):
        qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=3, **SETTINGS)
    for opt in (dict(speculative="ngram"), dict(deterministic=True)):
        with pytest.raises(InvalidRequestError, match="not available with tensor_parallel_size=2"):
            qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **opt)
    with pytest.raises(TensorParallelError, match="unknown faults"):
        inject_rank_fault(two, "melt")
    with pytest.raises(TensorParallelError, match="rank 2 is not a worker"):
        inject_rank_fault(two, "corrupt_plan", rank=2)
    with pytest.raises(TensorParallelError, match="needs a Session with tensor_parallel_size > 1"):
        inject_rank_fault(one, "corrupt_plan")
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=0 must be an int >= 1"):
        qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=0)


def test_a_hook_that_fails_or_edits_wrongly_at_rank_0_points_fails_the_step_only(pair):
    """At logits and final_norm (rank 0's points) as at sharded points: the hook's error is raised
    once every rank has finished the forward, the step rolls back, the group stays."""
    one, two = pair
    prefill_both(one, two, PROMPTS[3])

    def boom(x):
        raise ValueError("boom in hook")

    for name, fn, error, match in (("logits", boom, ValueError, "boom in hook"),
                                   ("final_norm", boom, ValueError, "boom in hook"),
                                   ("layers.1.attn.q", boom, ValueError, "boom in hook"),
                                   ("logits", lambda x: x[:, :7], InvalidRequestError, "expected a tensor of shape")):
        before = state_digest(two, kv=True)
        with two.intervene(name, fn), pytest.raises(error, match=match):
            two.step()
        assert state_digest(two, kv=True) == before, name
    assert two.step().kind == "decode" and two.check().ok


def test_reading_other_ranks_from_inside_a_step_is_refused_at_once(pair):
    """A hook runs while the workers wait in the step's collectives: a read from it would wait for
    them, so it is refused, the step rolls back, and the next step runs."""
    one, two = pair
    prefill_both(one, two, PROMPTS[3])
    before = state_digest(two, kv=True)
    started = time.monotonic()
    with two.intervene("layers.2.mlp.out", lambda x: two.kv.key(0) and None):
        with pytest.raises(TensorParallelError, match="inside a step's forward, which this call was made from"):
            two.step()
    assert time.monotonic() - started < TIMEOUT_S       # refused, not waited out
    assert state_digest(two, kv=True) == before and two.step().kind == "decode"


def test_a_read_from_another_thread_cannot_cancel_a_failed_steps_rollback(pair):
    """A step fails on rank 0 after every rank's forward; another thread reads the cache before the
    rollback reaches the workers: rank 1 still puts back the blocks the step took from the cache."""
    import threading
    one, two = pair
    two.reset()
    a = [3, 14, 15, 92, 65, 35, 89, 79, 32]                  # two full blocks, cached when it ends
    two.generate([a], SamplingParams(max_new_tokens=2, ignore_eos=True), progress=False)
    manager = two._engine.manager
    while manager.num_free_blocks > manager.num_cached_blocks:   # the next blocks come from the cache
        r = two.add_request([7] * 4 * (manager.num_free_blocks - manager.num_cached_blocks),
                            SamplingParams(max_new_tokens=1, ignore_eos=True))
        while r.status == "waiting" or r.num_computed_tokens < len(r.prompt_token_ids):
            two.step()
    two.add_request([27, 18, 28, 18, 28, 44, 61, 7, 9], SamplingParams(max_new_tokens=2, ignore_eos=True))
    before = state_digest(two, kv=True)
    read = threading.Event()

    def reader():
        two.kv.key(0)
        read.set()

    def fault(name):
        if name == "commit":
            threading.Thread(target=reader).start()
            assert read.wait(20)                          # the read ran inside the window
            raise RuntimeError("rank 0 fails after the forward")

    with inject_faults(fault), pytest.raises(RuntimeError, match="rank 0 fails"):
        two.step()
    assert state_digest(two, kv=True) == before


def test_a_killed_worker_is_named_and_close_leaves_no_process(pair):
    """Last in the file: it breaks the module's pair (closed again, idempotently, at teardown)."""
    _, sess = pair
    (pid,) = sess._engine.parallel.pids()
    try:
        sess.reset()
        sess.add_request(PROMPTS[0], GREEDY)
        sess.step()
        before = state_digest(sess)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match=r"group is lost: rank 1 \(pid \d+\) exited with code -9; found while"):
            sess.step()
        assert state_digest(sess) == before
        with pytest.raises(TensorParallelError, match="group is lost"):
            sess.step()
    finally:
        sess.close()
    assert not alive(pid)
    with pytest.raises(InvalidRequestError, match="session is closed"):
        sess.step()
    again = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    (pid2,) = again._engine.parallel.pids()
    assert alive(pid2) and again.generate(PROMPTS[0], GREEDY, progress=False)[0].token_ids
    again.close()
    assert not alive(pid2)


def test_a_failure_inside_a_workers_forward_loses_the_group_naming_the_rank():
    sess = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    (pid,) = sess._engine.parallel.pids()
    try:
        sess.add_request(PROMPTS[0], GREEDY)
        before = state_digest(sess)
        inject_rank_fault(sess, "exit_in_forward")
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"group is lost: .*rank 1 failed in the forward of step 0: "
                                                      r"RuntimeError: an injected fault inside the forward"):
            sess.step()
        assert time.monotonic() - started < TIMEOUT_S      # the worker's report, not the timeout
        assert state_digest(sess) == before
    finally:
        sess.close()
    assert not alive(pid)


@pytest.mark.parametrize("device, visible, message", [
    ("cuda:1", 4, "rank 0 \\(this process\\) must be on cuda:0, not cuda:1"),
    ("cuda:0", 1, "2 ranks need 2 cuda devices; 1 are visible"),
])
def test_too_few_devices_or_rank_0_elsewhere_is_refused_before_any_process_starts(monkeypatch, device, visible,
                                                                                 message):
    import qwen_npu.device as devices
    import qwen_npu.parallel.group as group_module
    monkeypatch.setattr(devices, "resolve_device", lambda spec: torch.device(device))
    monkeypatch.setattr(devices, "device_count", lambda kind: visible)
    monkeypatch.setattr(group_module.TensorParallelGroup, "start", lambda *a, **k: pytest.fail("a process started"))
    with pytest.raises(InvalidRequestError, match=message):
        qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), device=device, tensor_parallel_size=2,
                                         kernels="reference")


def test_a_script_without_the_main_guard_is_told_why_at_once(tmp_path):
    """Spawned workers import the main module; without ``if __name__ == "__main__":`` each one
    fails before it starts, and rank 0 says so at once instead of waiting for the timeout."""
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text("import qwen_npu\nfrom qwen_npu.testing import tiny_trained_qwen3\n"
                      "qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), kernels='reference', "
                      "tensor_parallel_size=2, num_blocks=8, block_size=4)\n")
    started = time.monotonic()
    timeout_s = 150                                          # what waiting it out would take
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=2 * timeout_s,
                         env={**os.environ, "QWEN_NPU_TP_TIMEOUT_S": str(timeout_s)})
    assert run.returncode != 0 and time.monotonic() - started < timeout_s
    assert "rank 1 (pid" in run.stderr and 'if __name__ == "__main__":' in run.stderr


def test_a_ctrl_c_as_an_exchange_begins_leaves_no_lock_behind():
    """SIGINT arriving as ``exchange`` starts (before Ctrl-C is held back): the read is interrupted,
    and another thread's read still goes through at once."""
    import sys
    import threading
    sess = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sess.add_request(PROMPTS[0], GREEDY)
        sess.step()
        fired = []

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "hold_interrupts" and not fired \
                    and frame.f_back is not None and frame.f_back.f_code.co_name == "exchange":
                fired.append(1)
                sys.settrace(None)
                os.kill(os.getpid(), signal.SIGINT)
            return None

        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                sess.kv.key(0)
        finally:
            sys.settrace(None)
        assert fired
        done = []
        t = threading.Thread(target=lambda: done.append(sess.kv.key(0).shape))
        t.start()
        t.join(20)
        assert done and done[0] == sess.kv.key(0).shape
    finally:
        signal.signal(signal.SIGINT, previous)
        sess.close()


def test_a_session_dropped_without_close_or_interrupted_while_built_leaves_nothing(monkeypatch):
    import gc

    import torch.distributed as dist

    import qwen_npu.engine.engine as engine_module
    sess = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    pids = qwen_npu.parallel.worker_pids(sess)
    del sess
    gc.collect()
    assert not any(alive(p) for p in pids) and not dist.is_initialized()
    real = engine_module.Engine.__init__

    def interrupted(self, *a, **k):
        real(self, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module.Engine, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    assert not dist.is_initialized()
    monkeypatch.undo()
    again = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    again.close()


def test_a_stopped_worker_is_named_within_the_timeout(monkeypatch):
    monkeypatch.setenv("QWEN_NPU_TP_TIMEOUT_S", "4")
    sess = qwen_npu.Session.from_pretrained(tiny_trained_qwen3(), tensor_parallel_size=2, **SETTINGS)
    (pid,) = qwen_npu.parallel.worker_pids(sess)
    try:
        sess.add_request(PROMPTS[0], GREEDY)
        sess.step()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) is stopped"):
            sess.step()                                      # found by the 4 s timeout
    finally:
        if alive(pid):                  # the group's loss already stopped it, or close() will
            os.kill(pid, signal.SIGCONT)
        sess.close()
    assert not alive(pid)
