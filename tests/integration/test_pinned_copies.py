"""Every host-to-device copy of a step goes through a pinned buffer and does not block.

No accelerator is needed: ``pinned.pins`` and ``pinned.pinned_empty`` (the seam of
``qwen_npu/engine/pinned.py``) are replaced so that a CPU Session pins its copies as it would on
a CUDA or NPU device, with ordinary host tensors standing in for the pinned ones (pinned memory
needs an accelerator runtime). A ``TorchFunctionMode`` records, during whole steps, every way data
reaches the device: ``copy_`` into a dispatch buffer, ``Tensor.to`` with a device, and tensors
created with a device. Each must read a pinned buffer and pass ``non_blocking=True``.
"""
from __future__ import annotations

import pytest
import torch
from session_kit import open_session, prompts
from torch.overrides import TorchFunctionMode

from qwen_npu import SamplingParams
from qwen_npu.engine import pinned

CREATORS = {torch.tensor, torch.as_tensor}          # host data made into a device tensor
INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables", "query_start_loc", "logits_index")


class Moves(TorchFunctionMode):
    """Records (what, source is pinned, non_blocking) for each way data can reach the device."""

    def __init__(self, fakes: list, inputs: set):
        super().__init__()
        self.fakes, self.inputs, self.moves = fakes, inputs, []

    def from_pinned(self, t: torch.Tensor) -> bool:
        return any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in self.fakes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and args[0].untyped_storage().data_ptr() in self.inputs:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self.moves.append(("copy_ into a dispatch buffer", self.from_pinned(args[1]), not blocking))
        elif func is torch.Tensor.to and (kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str)) for a in args[1:])):
            self.moves.append(("Tensor.to(device)", self.from_pinned(args[0]), bool(kwargs.get("non_blocking"))))
        elif func in CREATORS and kwargs.get("device") is not None:
            self.moves.append((f"torch.{func.__name__}(..., device=)", False, False))
        return func(*args, **kwargs)


@pytest.fixture
def as_accelerator(monkeypatch):
    """CPU Sessions made inside this fixture pin their copies; returns the stand-in pinned buffers."""
    fakes = []

    def fake_pinned(numel, dtype):
        fakes.append(torch.empty(numel, dtype=dtype))
        return fakes[-1]
    monkeypatch.setattr(pinned, "pins", lambda device: True)
    monkeypatch.setattr(pinned, "pinned_empty", fake_pinned)
    return fakes


def input_storages(sess) -> set:
    b = sess._engine.buffers
    return {t.untyped_storage().data_ptr() for n, t in b.tensors.items() if n.rpartition(".")[2] in INPUTS}


def run_recorded(sess, fakes, steps) -> list:
    rec = Moves(fakes, input_storages(sess))
    with rec:
        for s in steps:
            s()
    return rec.moves


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_every_step_copy_is_pinned_and_non_blocking(tiny_ckpt_small_vocab, as_accelerator, mixed):
    sess = open_session(tiny_ckpt_small_vocab, max_batch=4, chunk_size=8, mixed_steps=mixed)
    sampling = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.8, seed=3, ignore_eos=True),
                SamplingParams(max_new_tokens=6, temperature=1.1, seed=4, min_new_tokens=4, ignore_eos=True)]
    for p, s in zip(prompts((5, 11, 19)), sampling):
        sess.add_request(p, s)
    moves = run_recorded(sess, as_accelerator, [sess.step] * 8)
    step = []
    moves += run_recorded(sess, as_accelerator, [lambda: step.append(sess.decode_step()),
                                                 lambda: sess.sample(step[0], force=[7] * step[0].batch_size)])
    kinds = {s.kind for s in sess.history}
    assert "decode" in kinds and ("mixed" in kinds) == mixed
    assert len([m for m in moves if m[0].startswith("copy_")]) >= 7 * len(sess.history)
    assert any(m[0].startswith("Tensor.to") for m in moves), "the sampler's parameters were not seen"
    bad = [m for m in moves if not (m[1] and m[2])]
    assert not bad, f"copies to the device that are blocking or not from a pinned buffer: {bad[:5]}"


def test_committed_steps_use_the_two_pinned_sets_in_turn(tiny_ckpt_small_vocab, as_accelerator):
    sess = open_session(tiny_ckpt_small_vocab, max_batch=2)
    sess.add_request(prompts((6,))[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    decode = sess._engine.buffers.pinned["decode"]
    sess.step()                                        # the prefill
    seen = []
    for _ in range(3):
        seen.append(decode.current)
        sess.step()
    assert seen[1:] == [1 - seen[0], seen[0]]


def test_on_the_cpu_nothing_is_pinned(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, max_batch=2)
    assert sess._engine.buffers.pinned == {}
    assert all(sess._engine.buffers.staging(k) is None for k in ("decode", "prefill", "sample"))
    sess.add_request(prompts((6,))[0], SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True))
    moves = run_recorded(sess, [], [sess.step] * 3)
    assert moves and not any(m[2] for m in moves), "a CPU session made a non-blocking copy"


class Boom(Exception):
    pass


@pytest.mark.parametrize("point", ["validated", "dispatched", "booked", "sampled", "d2h", "staged", "commit"])
def test_a_step_that_fails_leaves_the_committed_pinned_set_as_it_was(tiny_ckpt_small_vocab, as_accelerator,
                                                                      point):
    """A failure at any phase of a step: the current sets and their bytes are those of the last
    committed step; the failed step wrote only the spare sets."""
    from qwen_npu.engine.transaction import inject_faults
    sess = open_session(tiny_ckpt_small_vocab, max_batch=2)
    sess.add_request(prompts((6,))[0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True))
    sess.step()
    sess.step()                                            # a committed decode step, sampled
    sets = sess._engine.buffers.pinned

    def committed():
        return {k: (s.current, {n: b.clone() for n, b in s._sets[s.current].items()}) for k, s in sets.items()}
    before = committed()

    def fail(name):
        if name == point:
            raise Boom(name)
    with inject_faults(fail), pytest.raises(Boom):
        sess.step()
    after = committed()
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    for kind, (_, bufs) in before.items():
        for name, b in bufs.items():
            assert torch.equal(after[kind][1][name], b), f"{kind} pinned {name} changed by a failed step"
    sess.step()                                            # and the next step runs normally
    assert sess.history[-1].kind == "decode"


class SlowEvent:
    """An event whose copies never leave the buffer (a device that makes no progress)."""

    def record(self):
        pass

    def query(self):
        return False


def test_a_step_waits_for_its_pinned_set_a_bounded_time(tiny_ckpt_small_vocab, as_accelerator, monkeypatch):
    """A device that never finishes the copies out of a pinned set: the next step that writes
    that set raises a DeviceError naming the device after ``WAIT_S``, and the session is whole."""
    from qwen_npu.errors import DeviceError
    sess = open_session(tiny_ckpt_small_vocab, max_batch=2)
    sess.add_request(prompts((6,))[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    sess.step()
    decode = sess._engine.buffers.pinned["decode"]
    monkeypatch.setattr(pinned, "WAIT_S", 0.05)
    decode._events = [SlowEvent(), SlowEvent()]
    digest = sess.state_digest()
    with pytest.raises(DeviceError, match="have not left it"):
        sess.step()
    assert sess.state_digest() == digest and sess.check().ok
    decode._events = [None, None]
    sess.step()
    assert sess.history[-1].kind == "decode"


def test_the_event_is_recorded_when_a_write_fails_half_way(tiny_ckpt_small_vocab, monkeypatch):
    """Copies queued before an error are waited for by the next writer: ``writing`` records the
    set's event on every way out."""
    recorded = []

    class Event:
        def record(self):
            recorded.append(self)

        def query(self):
            return True
    monkeypatch.setattr(pinned, "_event", lambda device: Event())
    copies = pinned.PinnedCopies(torch.device("meta"))
    with pytest.raises(RuntimeError, match="half way"), copies.writing():
        raise RuntimeError("half way")
    assert len(recorded) == 1 and copies._events[copies.spare] is recorded[0]


def test_a_backend_without_events_does_not_pin(monkeypatch):
    monkeypatch.setattr(pinned, "_event", lambda device: None)
    assert not pinned.pins(torch.device("meta"))
