"""`qwen-npu demo`: a guided tour of one session on a small random-weight Qwen3 it makes itself.

The checkpoint has the real Qwen3 tokenizer but random weights, so the text it writes is
nonsense; everything else — chunked prefill, block tables, slot mappings, a partial decode
batch dispatched as a runtime batch — is exactly what a real checkpoint goes through.

Every wait is announced before it starts: making the checkpoint, loading it, and (the first time
on a machine whose kernel choice is the C++ cpu set) building those kernels, which the Session
does while it is made, so the tour's timings never include it.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .engine.request import SamplingParams
from .session import Session
from .testing import make_tiny_qwen3

PROMPTS = [
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Hello!",
    "A block table maps each request's positions to physical blocks, and the slot mapping tells "
    "every new token where to write its key and value.",
]
MAX_NEW = (12, 4, 8)


def run_demo(out=print, model_dir: str | Path | None = None) -> Session:
    """Print the tour; returns the session for further poking."""
    from .device import cpu_kernels_choice
    out("qwen-npu demo: a random-weight Qwen3 with the real tokenizer (its text is nonsense by design)")
    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out(f"  loading {model_dir} ..." if model_dir else "  making a tiny random-weight Qwen3 and loading it "
            "(a few seconds; a first run on a CPU that uses the C++ kernels builds them first and says so)")
        path = Path(model_dir) if model_dir else make_tiny_qwen3(Path(tmp) / "tiny-qwen3", hidden_size=128,
                                                                num_hidden_layers=4, num_attention_heads=4,
                                                                num_key_value_heads=2, head_dim=32,
                                                                intermediate_size=256)
        sess = Session.from_pretrained(path, max_batch=4, block_size=8, chunk_size=16, num_blocks=64,
                                       max_model_len=256)
    out(f"  ready in {time.perf_counter() - t_setup:.1f} s (not counted below)")
    if sess.config.device == "cpu":
        out(f"  kernels: {sess.config.kernels}" + (f" ({cpu_kernels_choice()[1]})" if sess.config.kernels != "cpu"
                                                    else " (the C++ cpu set)"))
    out(f"  {sess!r}\n")
    reqs = []
    for prompt, n in zip(PROMPTS, MAX_NEW):
        r = sess.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
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
        out(f"      text: {r.text!r}")
    n_out = sum(len(r.output_token_ids) for r in reqs)
    out(f"\n{n_out} tokens generated in {total:.3f} s; decode: {decode_steps} steps, "
        f"{decode_tokens / max(decode_time, 1e-9):.1f} tokens/s")
    report = sess.check() if hasattr(sess, "check") else None
    if report is not None:
        out(f"cache check: {'ok' if report.ok else report.problems}")
    return sess
