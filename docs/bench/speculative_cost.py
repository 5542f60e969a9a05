"""What n-gram speculation (``speculative="ngram"``, k = 3) buys, against plain decoding.

Greedy, EOS ignored, ``kernels="auto"``, in one process. A copy-heavy workload (a prompt the
output repeats: an 8-token sequence listed 6 times, each request with its own first token) at
batch 1 and batch 16, 32 new tokens per request; and the shared ``mixed`` workload (32 requests,
``max_batch`` 16). Tokens per second of the whole ``generate`` call, and the share of drafts
accepted, overall and by draft position.
"""
from __future__ import annotations

import time

K = 3
COPY = [11, 12, 13, 14, 15, 16, 17, 18] * 6


def _run(path, prompts, news, speculate: bool) -> dict:
    from qwen_npu import SamplingParams, Session
    spec = {"speculative": "ngram", "num_speculative_tokens": K} if speculate else {}
    sess = Session.from_pretrained(path, max_batch=16, chunk_size=2048, max_model_len=2048, **spec)
    sess.generate([prompts[0][:16]], SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)   # warm
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    t = time.perf_counter()
    out = sess.generate(prompts, params, progress=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in out)
    res = {"tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 2), "tokens": tokens}
    if speculate:
        st = sess.speculation_stats()
        res.update(accepted=st.num_accepted, drafts=st.num_drafts,
                   by_position=[round(r, 2) for r in st.rate_by_position])
    sess.close()
    return res


def measure(path) -> dict:
    """{"copy b1" | "copy b16" | "mixed": {"plain": {...}, "ngram": {...}}}."""
    from qwen_npu.tools import workloads
    out = {}
    for name, batch in (("copy b1", 1), ("copy b16", 16)):
        prompts = [[100 + i] + COPY for i in range(batch)]
        out[name] = {mode: _run(path, prompts, [32] * batch, mode == "ngram") for mode in ("plain", "ngram")}
        print(f"speculation {name}: {out[name]}", flush=True)
    work = workloads.get_workload("mixed")
    prompts, news = [list(p) for p, _ in work], [n for _, n in work]
    out["mixed"] = {mode: _run(path, prompts, news, mode == "ngram") for mode in ("plain", "ngram")}
    print(f"speculation mixed: {out['mixed']}", flush=True)
    return out
