"""Property: with runtime-batch decode, no schedule trips a slot check or breaks an invariant.

Random schedules of add / prefill / decode / sample / abort on small caches (few blocks of 1..4
slots, so preemption and prefix sharing happen) run with slot_check="raise"; after every action
``sess.check()`` must be ok.
"""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen_npu import InvalidRequestError, OutOfBlocksError, SamplingParams, Session

BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]      # a shared prefix, so prefix blocks get shared

add = st.tuples(st.just("add"), st.integers(0, 8), st.integers(1, 5), st.integers(1, 8))
run = st.sampled_from([("step",), ("decode",), ("step",), ("prefill",), ("step",)])
abort = st.tuples(st.just("abort"), st.integers(0, 12))      # aborts live request i, if there is one
actions = st.lists(st.one_of(add, add, run, run, run, run, abort), min_size=12, max_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.integers(1, 4), num_blocks=st.integers(4, 10), max_batch=st.integers(1, 4),
       chunk_size=st.integers(1, 8), schedule=actions)
def test_runtime_schedules_never_trip_a_check(tiny_ckpt_small_vocab, block_size, num_blocks, max_batch,
                                              chunk_size, schedule):
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", block_size=block_size,
                                   num_blocks=num_blocks, max_batch=max_batch, chunk_size=chunk_size,
                                   max_model_len=48, slot_check="raise")
    for action in schedule:
        last = sess.last_step
        if last is not None and not last.sampled:
            sess.sample(last)                       # a pending step must be sampled before the next one
        name = action[0]
        try:
            if name == "add":
                _, shared, own, new = action
                sess.add_request(BASE[:shared] + [100 + own + k for k in range(own)],
                                 SamplingParams(max_new_tokens=new, ignore_eos=True))
            elif name == "prefill":
                sess.prefill()
            elif name == "decode":
                sess.decode_step()
            elif name == "step":
                sess.step()
            else:
                live = [r for r in sess.requests if not r.is_done]
                if action[1] < len(live):
                    sess.abort(live[action[1]])
        except OutOfBlocksError:
            pass                                    # a request larger than this small cache: refused up front
        except InvalidRequestError as e:
            assert "nothing to" in str(e), e        # only "nothing to run" is an acceptable refusal
        report = sess.check()
        assert report.ok, (action, report)
    assert sess._engine.ledger.num_collisions == 0
    assert all(not s.slot_problems for s in sess.history)
    for r in sess.requests:                         # and the cached K/V are what the tokens give
        if r.status in ("prefilling", "decoding") and r.num_computed_tokens:
            assert sess.audit(r).ok, r
