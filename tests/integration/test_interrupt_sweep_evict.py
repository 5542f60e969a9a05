"""A Ctrl-C at any line of a step that evicts cached prefix blocks leaves their K/V intact.

Request A finishes, leaving its two full prompt blocks in the prefix cache; request B (another
prompt) then needs every block, so its prefill step evicts A's. That step is interrupted at
every ``STRIDE``-th executed line of the package (``sweep_kit.CtrlC``; every line with
``QWEN_NPU_SWEEP_STRIDE=1``). After each trial the checks of ``test_interrupt_sweep.py`` hold
(the digest of before or after the step, ``check()``, a free call gate, SIGINT as before), and
then, with B aborted, A's prompt is added again: where the step did not take effect it finds
A's blocks still cached and reuses them. Before it finishes, ``sess.audit`` recomputes its K/V
densely and compares every slot it reads (K/V bytes a failed step left in a cached block show
here even though the digest does not see them); its finished tokens equal a fresh session's.

    QWEN_NPU_SWEEP_STRIDE=1 python -m pytest tests/integration/test_interrupt_sweep_evict.py
"""
from __future__ import annotations

import pytest
from sweep_kit import Call, World, ctrl_c_raises, stride, summary, sweep  # noqa: F401 (an autouse fixture)

from qwen_npu import SamplingParams

STRIDE = 7                        # the default run: every 7th executed line of the evicting step
SHORT = SamplingParams(max_new_tokens=2, ignore_eos=True)
AGAIN = SamplingParams(max_new_tokens=3, ignore_eos=True)
A = [3, 14, 15, 92, 65, 35, 89, 79, 32]                   # two full blocks of 4, cached once A finishes
B = [40 + i for i in range(17)]                            # five blocks: all of them
KW = dict(device="cpu", kernels="reference", max_batch=2, block_size=4, max_model_len=32, num_blocks=5,
          chunk_size=24, prefix_cache=True)
EVICTING = 4                                               # the index of B's prefill step below


def step(w):
    w.sess.step()


CALLS = [Call("add_request(A)", lambda w: w.sess.add_request(A, SHORT)), Call("step()", step),
         Call("step()", step), Call("add_request(B)", lambda w: w.sess.add_request(B, SHORT)),
         Call("step() evicting A's cached blocks", step)]


def run_again(w):
    """Abort B, run A's prompt again; returns (request, audit report taken while it decodes)."""
    sess = w.sess
    for r in sess.requests:
        if not r.is_done:
            sess.abort(r)
    again = sess.add_request(A, AGAIN)
    while again.status != "decoding":
        sess.step()
    report = sess.audit(again)
    while not again.is_done:
        sess.step()
    return again, report


@pytest.fixture
def fresh_tokens(tiny_ckpt_small_vocab):
    w = World(tiny_ckpt_small_vocab, KW)
    r = w.sess.add_request(A, AGAIN)
    while not r.is_done:
        w.sess.step()
    return r.output_token_ids


def test_the_step_evicts_what_a_cached(tiny_ckpt_small_vocab, fresh_tokens):
    """Without B, A's prompt again reuses two cached blocks; after B's step it reuses none."""
    for upto, cached in ((EVICTING, 8), (EVICTING + 1, 0)):
        w = World(tiny_ckpt_small_vocab, KW)
        for c in CALLS[:upto]:
            c.fn(w)
        again, report = run_again(w)
        assert again.num_cached_tokens == cached and report.ok and again.output_token_ids == fresh_tokens


def test_ctrl_c_at_any_line_of_an_evicting_step_leaves_cached_kv_intact(tiny_ckpt_small_vocab, fresh_tokens):
    reused = []

    def after(w, took_effect):
        try:
            again, report = run_again(w)
        except Exception as e:  # noqa: BLE001 (any failure is a finding)
            return [f"running A's prompt again raised {type(e).__name__}: {e}"]
        reused.append(again.num_cached_tokens)
        problems = []
        if not report.ok:
            problems.append(f"audit of A's prompt again ({again.num_cached_tokens} tokens from the prefix "
                            f"cache) fails: {str(report)[:300]}")
        if again.output_token_ids != fresh_tokens:
            problems.append(f"A's prompt again gives {again.output_token_ids}, a fresh session "
                            f"{fresh_tokens}")
        return problems

    trials, problems = sweep(tiny_ckpt_small_vocab, KW, CALLS, stride(STRIDE), after=after, only=[EVICTING])
    print(f"evicting step: {trials} trials, {sum(n > 0 for n in reused)} reused A's cached blocks")
    assert trials > 1 and any(reused), "no trial left A's blocks cached: the sweep tested nothing"
    assert not problems, summary("evicting step", problems)
