"""`qwen-npu demo`: a guided tour of one session on the small trained Qwen3 shipped with the package.

The model (``qwen_npu.testing.tiny_trained_qwen3``, 2.4M parameters trained on WordNet's English)
continues English prompts with short English phrases; chunked prefill, block tables, slot
mappings and a partial decode batch dispatched as a runtime batch are exactly what a full-size
checkpoint goes through.

Every wait is announced before it starts: loading the checkpoint and (the first time on a
machine whose kernel choice is the C++ cpu set) building those kernels, which the Session does
while it is made, so the tour's timings never include it.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..engine.request import SamplingParams
from ..model.hub import checkpoint_folder
from ..session.options import SessionOptions
from ..session.session import Session
from ..testing import tiny_trained_qwen3

PROMPTS = [
    "music means",
    "an animal that",
    ("the capital of the state, a large city on the shore of a lake with a busy port and an old "
     "university, is a large city in the north of"),
]
MAX_NEW = (16, 8, 12)
# small enough that the tour's prompts span several chunks and blocks
DEMO_OPTIONS = SessionOptions(max_batch=4, block_size=8, chunk_size=16, num_blocks=64, max_model_len=256)


def run_demo(out=print, model_dir: str | Path | None = None) -> Session:
    """Print the tour; returns the session for further poking."""
    from ..device import cpu_kernels_choice
    path = checkpoint_folder(model_dir) if model_dir else tiny_trained_qwen3()
    what = "the checkpoint at " + str(path) if model_dir else \
        "the small Qwen3 trained on WordNet's English that ships with qwen-npu (greedy decoding)"
    out(f"qwen-npu demo: {what}")
    t_setup = time.perf_counter()
    out("  loading it (a few seconds; a first run on a CPU that uses the C++ kernels builds them first "
        "and says so)")
    sess = Session.from_pretrained(path, **DEMO_OPTIONS.kwargs())
    out(f"  ready in {time.perf_counter() - t_setup:.1f} s (not counted below)")
    if sess.config.device == "cpu":
        out(f"  kernels: {sess.config.kernels}" + (f" ({cpu_kernels_choice()[1]})" if sess.config.kernels != "cpu"
                                                    else " (the C++ cpu set)"))
    out(f"  {sess!r}\n")
    reqs = []
    for prompt, n in zip(PROMPTS, MAX_NEW):
        r = sess.add_request(prompt, SamplingParams(max_new_tokens=n))      # greedy, ends at eos
        reqs.append(r)
        out(f"request {r.id}: {len(r.prompt_token_ids)} prompt tokens, up to {n} new  <- {prompt[:48]!r}")
    out(f"\n1. Chunked prefill: at most chunk_size={sess.config.chunk_size} prompt tokens per step, "
        f"blocks of {sess.config.block_size} slots")
    t0 = time.perf_counter()
    while any(r.status in ("waiting", "prefilling") for r in reqs):
        step = sess.prefill()
        out(f"   step {step.index}: rows {step.request_ids} compute {step.query_lens.tolist()} tokens; "
            f"logits for requests {step.logits_request_ids}")
        if step.logits is not None:
            sess.sample(step)
    out("\n2. Block tables after prefill (physical block ids, in position order):")
    for r in reqs:
        out(f"   request {r.id}: {r.block_table}  ({r.num_computed_tokens} tokens computed)")
    out("\n3. Decode: one token per decoding request each step; only the active rows are dispatched")
    decode_steps = decode_tokens = 0
    shown_partial = False
    td = time.perf_counter()
    while any(not r.is_done for r in reqs):
        step = sess.step()
        if step.kind != "decode":
            continue
        decode_steps += 1
        decode_tokens += step.batch_size
        if step.batch_size < len(reqs) and not shown_partial:
            shown_partial = True
            out(f"   step {step.index} is a partial batch: {step.batch_size} of {len(reqs)} requests still "
                f"running, so {step.batch_size} rows are dispatched (capacity {sess.config.max_batch})")
            out(f"     request_ids  {step.request_ids}")
            out(f"     positions    {step.positions.tolist()}")
            out(f"     slot_mapping {step.slot_mapping.tolist()}  (slot = block * {sess.config.block_size} + offset)")
            out(f"     block_tables {[row[row >= 0].tolist() for row in step.block_tables]}")
    decode_time = time.perf_counter() - td
    total = time.perf_counter() - t0
    out("\n4. Output streams:")
    for r in reqs:
        out(f"   request {r.id} ({r.finish_reason}, {len(r.output_token_ids)} tokens): {r.output_token_ids}")
        out(f"      ...{(r.prompt_text or '')[-32:]!r} -> {r.text!r}")
    n_out = sum(len(r.output_token_ids) for r in reqs)
    out(f"\n{n_out} tokens generated in {total:.3f} s; decode: {decode_steps} steps, "
        f"{decode_tokens / max(decode_time, 1e-9):.1f} tokens/s")
    report = sess.check() if hasattr(sess, "check") else None
    if report is not None:
        out(f"cache check: {'ok' if report.ok else report.problems}")
    return sess
