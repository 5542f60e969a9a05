"""Every warning the toolkit raises points at the user's line: the first frame outside the
qwen_npu package and its kernels folder, however deep inside the toolkit it was raised."""
from __future__ import annotations

import inspect
import warnings

from collision_kit import open_session, tampered_plans, two_decoding

from qwen_npu import FaultEmulationWarning, SlotCollisionWarning
from qwen_npu.cache.slot_check import check_slot_mapping, raise_or_warn
from qwen_npu.engine.faults import EmulatedFault, warn_faults

HERE = __file__


def caught(call, category):
    """(filename, line) of the one ``category`` warning ``call()`` raises."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    ours = [w for w in seen if issubclass(w.category, category)]
    assert len(ours) == 1, [str(w.message) for w in seen]
    return ours[0].filename, ours[0].lineno


def test_helpers_point_at_their_caller():
    problems = list(check_slot_mapping([3, 3], [[0], [0]], 4, positions=[3, 3]).items)
    assert problems
    line = inspect.currentframe().f_lineno
    assert caught(lambda: raise_or_warn(problems, "warn"), SlotCollisionWarning) == (HERE, line + 1)
    fault = EmulatedFault("zero_on_collision", 1, 5, 1, 1, (0, 1), (0, 1), (3, 3))
    assert caught(lambda: warn_faults([fault]), FaultEmulationWarning) == (HERE, line + 3)


def test_a_slot_collision_warning_from_a_step_points_at_the_call(tiny_ckpt_small_vocab, monkeypatch):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="warn")
    two_decoding(sess)

    def duplicate(plan):
        plan.slot_mapping[1] = plan.slot_mapping[0]
    with tampered_plans(monkeypatch, duplicate):
        line = inspect.currentframe().f_lineno
        assert caught(lambda: sess.decode_step(), SlotCollisionWarning) == (HERE, line + 1)
