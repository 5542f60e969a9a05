"""The `seed` workload with the prefix cache on and off: prefill tokens computed and wall time.

16 identical 512-token prompts, 64 greedy tokens each (EOS ignored), max_batch 16, on a small
random Qwen3 (hidden 256, 4 layers). Runs on and off alternately, ``--reps`` times each, checks
that every run gives the same tokens, and prints one JSON line per run and a summary line.

    python docs/bench/prefix_cache_seed.py [--threads 1] [--reps 3] [--vocab 151936] [--device cpu]

With ``--vocab`` below the workload's token ids, prompt tokens are taken modulo ``vocab - 1``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.tools import workloads
from qwen_npu.testing import make_tiny_qwen3


def run(ckpt: Path, prompts, sampling, device: str, prefix_cache: bool):
    sess = Session.from_pretrained(ckpt, device=device, max_batch=16, max_model_len=2048,
                                   prefix_cache=prefix_cache)
    sess.generate([prompts[0][:32]], SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)
    sess.reset()
    t = time.perf_counter()
    outs = sess.generate(prompts, sampling, progress=False)
    seconds = time.perf_counter() - t
    steps = list(sess.history)
    prefill = [s for s in steps if s.kind == "prefill"]
    result = {"prefix_cache": prefix_cache, "seconds": round(seconds, 3), "steps": len(steps),
              "prefill_steps": len(prefill), "prefill_tokens": sum(int(s.query_lens.sum()) for s in prefill),
              "prefill_forward_s": round(sum(s.timings.get("forward", 0.0) for s in prefill), 3),
              "hit_tokens": sess.prefix_cache_stats.hit_tokens,
              "out_tokens": sum(len(c.token_ids) for c in outs)}
    return result, [c.token_ids for c in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = workloads.WORKLOADS["seed"]()
    prompts = [[t % (args.vocab - 1) for t in p] for p, _ in work]
    sampling = [SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in work]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_qwen3(Path(tmp) / "ckpt", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=args.vocab)
        runs = {True: [], False: []}
        for _ in range(args.reps):
            for prefix_cache in (True, False):
                result, tokens = run(ckpt, prompts, sampling, args.device, prefix_cache)
                runs[prefix_cache].append((result, tokens))
                print(json.dumps(result), flush=True)
    reference = runs[False][0][1]
    on, off = [r for r, _ in runs[True]], [r for r, _ in runs[False]]
    best = {k: (min(r["seconds"] for r in v), min(r["prefill_forward_s"] for r in v))
            for k, v in (("on", on), ("off", off))}
    print(json.dumps({
        "tokens_identical": all(t == reference for v in runs.values() for _, t in v),
        "prefill_tokens_on": on[0]["prefill_tokens"], "prefill_tokens_off": off[0]["prefill_tokens"],
        "prefill_tokens_saved": off[0]["prefill_tokens"] - on[0]["prefill_tokens"],
        "best_seconds_on": best["on"][0], "best_seconds_off": best["off"][0],
        "speedup": round(best["off"][0] / best["on"][0], 2),
        "prefill_forward_speedup": round(best["off"][1] / best["on"][1], 2)}))


if __name__ == "__main__":
    main()
