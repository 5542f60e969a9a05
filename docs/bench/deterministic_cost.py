"""What ``deterministic=True`` (batch-invariant kernels) costs, against the ordinary kernels.

Whole Session steps, ``kernels="auto"``, in one process: a 512-token prefill (tokens per second,
the best of 3), and decode steps plus their sample at batch 1 and 16 with every row at context
128 (median of 8). The two modes alternate round by round, so drift of the host's speed falls
on both; each figure is the median of the rounds.
"""
from __future__ import annotations

import statistics
import time

PREFILL, CONTEXT, STEPS = 512, 128, 8


def _session(path, deterministic: bool):
    from qwen_npu import Session
    return Session.from_pretrained(path, max_batch=16, chunk_size=2048, max_model_len=1024, prefix_cache=False,
                                   deterministic=deterministic)


def _prefill_tok_s(path, deterministic: bool) -> float:
    from qwen_npu import SamplingParams
    sess, best = _session(path, deterministic), float("inf")
    for i in range(3):
        sess.add_request(list(range(100 + i, 100 + i + PREFILL)), SamplingParams(max_new_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        step = sess.prefill()
        best = min(best, time.perf_counter() - t)
        sess.sample(step)
    sess.close()
    return PREFILL / best


def _decode_ms(path, deterministic: bool, batch: int) -> float:
    from qwen_npu import SamplingParams
    sess = _session(path, deterministic)
    for i in range(batch):
        sess.add_request(list(range(10 + i, 10 + i + CONTEXT)), SamplingParams(max_new_tokens=STEPS + 4,
                                                                                 ignore_eos=True))
    while any(r.status != "decoding" for r in sess.requests):
        sess.step()
    sess.sample(sess.decode_step())
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        sess.sample(sess.decode_step())
        times.append(time.perf_counter() - t)
    sess.close()
    return 1e3 * statistics.median(times)


def measure(path, rounds: int = 3) -> dict:
    """{"ordinary"|"deterministic": {"prefill_tok_s", "decode_b1_ms", "decode_b16_ms"}} (medians)."""
    runs = {"ordinary": [], "deterministic": []}
    for _ in range(rounds):
        for mode in runs:
            det = mode == "deterministic"
            runs[mode].append({"prefill_tok_s": _prefill_tok_s(path, det), "decode_b1_ms": _decode_ms(path, det, 1),
                               "decode_b16_ms": _decode_ms(path, det, 16)})
            print(f"deterministic cost, {mode}: {runs[mode][-1]}", flush=True)
    return {mode: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]} for mode, rs in runs.items()}
