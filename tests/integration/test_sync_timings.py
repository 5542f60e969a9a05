"""Per-phase timings that hold on an asynchronous device: with ``sync_timings`` on, the prepare and
forward phases each end at a device synchronisation, before their clock stops.

The CPU has nothing to wait for, so the device's ``synchronize`` is replaced by a recorder: the
tests check where the synchronisations fall among the forward calls, never how long anything took.
``QWEN_NPU_SYNC_TIMINGS`` is read when the Session is created ("1" = on; default off).
"""
import pytest
from session_kit import greedy, open_session, prompts

import qwen_npu.engine.runner as runner_module

ENV = "QWEN_NPU_SYNC_TIMINGS"


def record_events(sess, monkeypatch) -> list[str]:
    """Log 'sync' for every device synchronisation and 'forward' for every model call of ``sess``."""
    events: list[str] = []
    runner = sess._engine.runner
    model = runner.model

    class Recorded:
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *args, **kwargs):
            events.append("forward")
            return model(*args, **kwargs)

    monkeypatch.setattr(runner_module, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(runner, "model", Recorded())
    return events


@pytest.mark.parametrize("deterministic", [False, True], ids=["ordinary", "batch-invariant"])
def test_on_each_phase_ends_at_a_synchronisation(tiny_ckpt_small_vocab, monkeypatch, deterministic):
    sess = open_session(tiny_ckpt_small_vocab, sync_timings=True, deterministic=deterministic,
                        kernels="reference")
    assert sess.config.sync_timings is True
    events = record_events(sess, monkeypatch)
    sess.add_request(prompts([3])[0], greedy(2))
    step = sess.step()                                   # a prefill of 3 tokens, in one forward either way
    assert events == ["sync", "forward", "sync"]         # after prepare, after the forward
    assert set(step.timings) >= {"prepare", "forward", "sample"}
    events.clear()
    sess.step()                                          # a decode step
    assert events == ["sync", "forward", "sync"]


def test_off_by_default_no_synchronisation(tiny_ckpt_small_vocab, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    sess = open_session(tiny_ckpt_small_vocab, kernels="reference")
    assert sess.config.sync_timings is False
    events = record_events(sess, monkeypatch)
    sess.add_request(prompts([3])[0], greedy(2))
    sess.step()
    sess.step()
    assert events == ["forward", "forward"]


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("1", True)], ids=["unset", "0", "1"])
def test_environment_variable_when_not_given(tiny_ckpt_small_vocab, monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert open_session(tiny_ckpt_small_vocab, kernels="reference").config.sync_timings is on
    assert open_session(tiny_ckpt_small_vocab, kernels="reference",
                        sync_timings=not on).config.sync_timings is (not on)


def test_same_tokens_with_and_without(tiny_ckpt_small_vocab):
    outs = []
    for sync in (False, True):
        sess = open_session(tiny_ckpt_small_vocab, sync_timings=sync, kernels="reference")
        outs.append([c.token_ids for c in sess.generate(prompts([5, 9]), greedy(4), progress=False)])
    assert outs[0] == outs[1]
