"""The comparison run of ``qwen-npu bench --compare hf``: Hugging Face ``generate`` on a workload.

The usual way to batch with ``generate``: requests in groups of 16 in workload order, each group
left-padded to its longest prompt and run for its largest output count (every row generates
that many tokens, only the requested ones are counted), greedy, with a static KV cache.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

GROUP = 16


def run_hf_generate(path: str | Path, work: list[tuple[list[int], int]], *, device: str = "cpu",
                    workload: str = "custom", dtype: str = "auto") -> dict:
    """Time ``work`` through transformers ``generate`` after a 4-token warm-up; one flat dict.
    ``dtype``: ``auto`` (the checkpoint's), ``float32`` or ``bfloat16``."""
    from transformers import AutoModelForCausalLM
    dev = torch.device(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype if dtype == "auto" else getattr(torch, dtype)).to(dev).eval()
    load_s = time.perf_counter() - t0
    n_in = sum(len(p) for p, _ in work)
    n_out = sum(n for _, n in work)
    with torch.inference_mode():
        model.generate(torch.tensor([work[0][0][:32]], device=dev), max_new_tokens=4, do_sample=False)
        _sync(dev)
        t0 = time.perf_counter()
        for start in range(0, len(work), GROUP):
            group = work[start:start + GROUP]
            width = max(len(p) for p, _ in group)
            steps = max(n for _, n in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(group):
                ids[row, width - len(prompt):] = torch.tensor(prompt)          # left padding
                mask[row, width - len(prompt):] = 1
            model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, cache_implementation="static", pad_token_id=0)
        _sync(dev)
        seconds = time.perf_counter() - t0
    out = {"engine": "hf-generate", "workload": workload, "seconds": round(seconds, 3), "out_tokens": n_out,
           "out_tok_s": round(n_out / seconds, 2), "total_tok_s": round((n_in + n_out) / seconds, 2),
           "load_s": round(load_s, 2), "dtype": str(model.dtype).removeprefix("torch.")}
    del model
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
