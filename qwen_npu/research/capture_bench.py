"""What a capture costs: the time of one batch-16 decode step under each capture form, against
no capture, measured interleaved (each round runs every form once, so drift hits all alike), and
the bytes each keeps per step.

    from qwen_npu.research.capture_bench import capture_overhead
    capture_overhead(sess, rounds=5)   # {form: {"step_s", "ratio", "cpu_s", "cpu_ratio", "bytes_per_step"}}

Wall time and process CPU time are both reported: on a shared host the CPU time is the steadier
measure of the work a form adds.

Forms: none; one small point (the cost of running with a hook at all: the unfused q/k norm and
RoPE, the materialised residual stream); every point but the scores ("*") kept on the device; the residual stream only with
positions="last"; "*" reduced on the device with norm(); "*" with mean_positions(); "*" offloaded
to the host; "*" streamed to a callback that keeps nothing. ``python -m
qwen_npu.research.capture_bench [checkpoint]`` prints the table for the 0.6B-shaped random bf16
checkpoint of ``qwen-npu bench`` (written once).
"""
from __future__ import annotations

import statistics
import sys
import time

from ..engine.request import SamplingParams
from .reductions import mean_positions, norm

FORMS = {
    "none": None,
    "one point (the hook path alone)": dict(names="embed"),
    "all points, on device": dict(names="*"),
    "residual stream, positions='last'": dict(names="layers.*.residual", positions="last"),
    "all points, reduce=norm()": dict(names="*", reduce=norm()),
    "all points, reduce=mean_positions()": dict(names="*", reduce=mean_positions()),
    "all points, offload='host'": dict(names="*", offload="host"),
    "all points, streamed (on_step)": dict(names="*", on_step=lambda s: None),
}


def capture_overhead(sess, *, batch: int = 16, prompt_len: int = 32, rounds: int = 5) -> dict:
    """Median decode-step seconds and bytes kept per step of each form (see module docstring)."""
    steps = rounds * len(FORMS) + 2
    for i in range(batch):
        sess.add_request([(7 * i + j) % 1000 + 10 for j in range(prompt_len)],
                         SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
    while any(r.status != "decoding" for r in sess.requests):
        sess.step()
    sess.step()                                                  # one unmeasured decode step
    times = {f: [] for f in FORMS}
    cpu = {f: [] for f in FORMS}
    kept = {f: [] for f in FORMS}
    for _ in range(rounds):
        for form, opts in FORMS.items():
            if opts is None:
                t0, c0 = time.perf_counter(), time.process_time()
                sess.step()
                times[form].append(time.perf_counter() - t0)
                cpu[form].append(time.process_time() - c0)
                kept[form].append(0)
                continue
            opts = dict(opts)
            with sess.capture(opts.pop("names"), **opts) as cap:
                t0, c0 = time.perf_counter(), time.process_time()
                sess.step()
                times[form].append(time.perf_counter() - t0)
                cpu[form].append(time.process_time() - c0)
            kept[form].append(cap.nbytes)
    base, base_cpu = statistics.median(times["none"]), statistics.median(cpu["none"])
    return {f: {"step_s": statistics.median(t), "ratio": statistics.median(t) / base,
                "cpu_s": statistics.median(cpu[f]), "cpu_ratio": statistics.median(cpu[f]) / base_cpu,
                "bytes_per_step": int(statistics.median(kept[f]))} for f, t in times.items()}


def main(argv=None) -> None:
    from ..tools.bench import ensure_default_model
    from ..session.session import Session
    argv = sys.argv[1:] if argv is None else argv
    path = ensure_default_model(argv[0] if argv else None, log=print)
    sess = Session.from_pretrained(path, device="cpu", max_batch=16, max_model_len=256, prefix_cache=False)
    res = capture_overhead(sess)
    print(f"{'form':36s} {'step ms':>9s} {'ratio':>6s} {'cpu ms':>9s} {'ratio':>6s} {'kept per step':>14s}")
    for form, r in res.items():
        print(f"{form:36s} {1000 * r['step_s']:9.1f} {r['ratio']:6.2f} {1000 * r['cpu_s']:9.1f} "
              f"{r['cpu_ratio']:6.2f} {r['bytes_per_step'] / 2**20:10.2f} MiB")


if __name__ == "__main__":
    main()
