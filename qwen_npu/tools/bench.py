"""`qwen-npu bench`: run a shared workload through a Session and report how fast it went.

    load the checkpoint ─> 4-token warm-up ─> [timed] every request of the workload, added at
    once, stepped with ``Session.step()`` until all finish ─> decode probes at batch 1 and 16
    ─> (on a CPU) the machine's limits: read bandwidth, multiply-add peaks (and torch's product
       rates beside them), and every figure as a share of them
    ─> (--compare hf) the same workload through Hugging Face ``generate``, in the dtype a user
       would pick here (float32 where torch's bf16 products are slower), or in both

Greedy, EOS ignored (each request produces exactly its count), ``max_batch`` 16,
``max_model_len`` 2048. ``seconds`` is the timed part only. As in the peer scripts, the warm-up
prompt is the first 32 tokens of the first request (so the prefix cache may hold them). The default checkpoint has the
shapes of Qwen3-0.6B with random bf16 weights; it is written once into a cache folder.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from . import bench_floors, workloads
from .bench_report import format_text
from .. import device as devices
from ..config import ModelConfig
from ..engine.request import SamplingParams
from ..errors import InvalidRequestError
from ..model.hub import checkpoint_folder
from ..session.options import SessionOptions

MAX_BATCH = 16
MAX_MODEL_LEN = 2048
BENCH_OPTIONS = SessionOptions(max_batch=MAX_BATCH, max_model_len=MAX_MODEL_LEN)   # what run_bench starts from
WARMUP_PROMPT, WARMUP_TOKENS = 32, 4
PROBE_CONTEXT, PROBE_STEPS = 128, 8
QWEN3_06B_SHAPE = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
                       tie_word_embeddings=True)


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "qwen-npu" / "qwen3-0.6b-random"


def ensure_default_model(path: Path | None = None, *, log=None) -> Path:
    """The Qwen3-0.6B-shaped random bf16 checkpoint at ``path``, written there first if missing.

    Written into a sibling folder and renamed, so an interrupted write never leaves a partial
    checkpoint behind. Uses the real Qwen3 tokenizer when it is installed, else token ids only.
    """
    path = Path(path or default_model_dir())
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    from ..testing import make_tiny_qwen3, tokenizer_files_dir
    try:
        tokenizer_files_dir()
        vocab = None
    except FileNotFoundError:
        vocab = 151936
    if log:
        log(f"writing a Qwen3-0.6B-shaped random bf16 checkpoint to {path} (once)")
    tmp = path.with_name(path.name + f".partial-{os.getpid()}")
    make_tiny_qwen3(tmp, vocab_size=vocab, dtype=torch.bfloat16, **QWEN3_06B_SHAPE)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path


def _peak_rss() -> int:
    """Peak resident memory of this process in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rss_now() -> int:
    """Resident memory of this process now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run_workload(sess, work: workloads.Workload, shapes: list | None = None) -> dict:
    """Add every request of ``work`` at once and step until all finish; figures of the run.
    ``shapes``, when given, gets one (tokens computed, logits rows) per step."""
    reqs = [sess.add_request(list(p), _greedy(n)) for p, n in work]
    prefill_s = prefill_tokens = d2h = h2d = 0
    decode: dict[int, list[float]] = {}
    mixed, mixed_tokens = [], 0
    t0 = time.perf_counter()
    while not all(r.is_done for r in reqs):
        ts = time.perf_counter()
        step = sess.step()
        dt = time.perf_counter() - ts
        d2h += step.transfers["d2h"]
        h2d += step.transfers["h2d"]
        if shapes is not None:
            shapes.append((len(step.plan.input_ids), len(step.plan.logits_index)))
        if step.kind == "prefill":
            prefill_s += dt
            prefill_tokens += int(step.query_lens.sum())
        elif step.kind == "mixed":             # decode rows and prefill chunks in one forward
            mixed.append(dt)
            mixed_tokens += int(step.query_lens.sum())
        else:
            decode.setdefault(step.batch_size, []).append(dt)
    seconds = time.perf_counter() - t0
    n_in = sum(len(p) for p, _ in work)
    n_out = sum(len(r.output_token_ids) for r in reqs)
    full = decode.get(sess.config.max_batch, [])
    return {
        "seconds": round(seconds, 3), "out_tokens": n_out, "prompt_tokens": n_in,
        "out_tok_s": round(n_out / seconds, 2), "total_tok_s": round((n_in + n_out) / seconds, 2),
        "prefill_tokens": prefill_tokens, "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(prefill_tokens / prefill_s, 1) if prefill_s else None,
        "decode_steps": sum(len(v) for v in decode.values()), "decode_s": round(sum(map(sum, decode.values())), 3),
        "decode_ms_workload_b16": round(1e3 * statistics.median(full), 2) if full else None,
        "mixed_step_count": len(mixed), "mixed_s": round(sum(mixed), 3), "mixed_tokens": mixed_tokens,
        "d2h_bytes_per_token": round(d2h / max(n_out, 1), 2), "h2d_bytes_per_token": round(h2d / max(n_out, 1), 2),
    }


def decode_probe(sess, batch: int, *, context: int = PROBE_CONTEXT,
                 steps: int = PROBE_STEPS) -> tuple[float, float]:
    """(median milliseconds of a whole decode step, median milliseconds of it outside the forward:
    the host's share — scheduling, planning, checks, sampling, commit) with ``batch`` rows at a
    context of ``context``. The rows share one prompt (with the prefix cache on, it is computed
    once). Resets the session."""
    sess.reset()
    prompt = workloads.custom(context, 1, n=1)[0][0]
    reqs = [sess.add_request(prompt, _greedy(steps + 1)) for _ in range(batch)]
    times, host = [], []
    while not all(r.is_done for r in reqs):
        ts = time.perf_counter()
        step = sess.step()
        if step.kind == "decode" and step.batch_size == batch:
            times.append(time.perf_counter() - ts)
            host.append(times[-1] - step.timings.get("forward", 0.0))
    sess.reset()
    return round(1e3 * statistics.median(times), 2), round(1e3 * statistics.median(host), 3)


def _blocks_for(work: workloads.Workload, block_size: int, max_batch: int) -> int:
    """Enough KV blocks for the ``max_batch`` longest requests at once, plus a little slack."""
    longest = sorted((-(-(len(p) + n) // block_size) for p, n in work), reverse=True)
    return sum(longest[:max_batch]) + max_batch + 8


PEER_DTYPES = ("auto", "float32", "bfloat16", "both")


def peer_dtypes(choice: str, user: str) -> list[str]:
    """The dtypes to run a peer in for ``choice`` (one of ``PEER_DTYPES``), ``user`` (the dtype a
    user would pick here, ``bench_floors.user_dtype``) first."""
    other = "bfloat16" if user == "float32" else "float32"
    return {"auto": [user], "both": [user, other]}.get(choice, [choice])


def run_bench(work="mixed", *, model=None, compare: str | None = None, probes: bool = True, floors: bool = True,
              peer_dtype: str = "auto", log=None, **options) -> dict:
    """Load, warm up and time ``work`` (a workload name or a list of (prompt ids, new tokens)).

    Returns a flat dict: the run's figures (``seconds``, ``out_tokens``, ``out_tok_s``,
    ``total_tok_s``, prefill and decode figures, ``peak_rss_bytes``, transfers per token), the
    setup, and with ``compare="hf"`` the Hugging Face figures under ``hf`` plus ``hf_ratio``
    (Hugging Face seconds / ours: above 1 means faster than Hugging Face). On a CPU, ``floors``
    adds the machine's floors (``qwen_npu.tools.bench_floors``) and the decode probes' ratios to them.
    ``peer_dtype``: Hugging Face's dtype, ``auto`` (float32 unless torch's bf16 products are the
    faster here), ``float32``, ``bfloat16`` or ``both`` (then ``hf`` is the ``auto`` one and
    ``hf_by_dtype`` holds both). ``options``: Session options (``SessionOptions``) over
    ``BENCH_OPTIONS``, e.g. ``device``, ``kernels``, ``prefix_cache``, ``mixed_steps`` (decode
    rows and prefill chunks share steps; ``mixed_step_count``/``mixed_s`` count those steps);
    ``num_blocks`` defaults to enough for the workload.
    """
    from ..session.session import Session
    opts = BENCH_OPTIONS.replace(**options)
    if compare not in (None, "hf"):
        raise InvalidRequestError(f"compare={compare!r}: the only comparison built in is 'hf'")
    if peer_dtype not in PEER_DTYPES:
        raise InvalidRequestError(f"peer_dtype={peer_dtype!r}: choose one of {', '.join(PEER_DTYPES)}")
    name = work if isinstance(work, str) else "custom"
    if isinstance(work, str):
        work = workloads.get_workload(work)
    if not work:
        raise InvalidRequestError("the workload is empty")
    path = checkpoint_folder(model, opts.revision) if model is not None else ensure_default_model(log=log)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    top = max(max(p) for p, _ in work)
    if top >= vocab:
        raise InvalidRequestError(f"{path}: the workload uses token ids up to {top} but the checkpoint's "
                                  f"vocabulary has {vocab}; benchmark a checkpoint with the Qwen3 vocabulary")
    device = devices.resolve_device(opts.device)
    block_size = opts.block_size or devices.default_block_size(device)
    if opts.num_blocks is None and opts.kv_memory is None:
        opts = opts.replace(num_blocks=max(_blocks_for(work, block_size, opts.max_batch),
                                           opts.max_batch * (PROBE_CONTEXT // block_size + 2)))
    t0 = time.perf_counter()
    opts = opts.replace(kernels=devices.prepare_kernels(opts.kernels, device))   # a first build, timed apart
    build_s = time.perf_counter() - t0
    rss_before_load = _rss_now()
    t0 = time.perf_counter()
    sess = Session.from_pretrained(path, **opts.replace(revision=None).kwargs())
    load_s = time.perf_counter() - t0
    cfg = sess.config
    t0 = time.perf_counter()
    sess.generate([work[0][0][:WARMUP_PROMPT]], _greedy(WARMUP_TOKENS), progress=False)
    warmup_s = time.perf_counter() - t0
    if log:
        log(f"loaded {path} in {load_s:.1f} s ({cfg.dtype}, {cfg.device}, kernels {cfg.kernels}); running "
            f"{name}: {len(work)} requests")
    limits_before, before_error = None, None
    if floors and sess.model.device.type == "cpu":
        if log:
            log("measuring the machine's limits before the run (read bandwidth, multiply-add peaks, torch's "
                "product rates; again after it, and the shares use the higher of each)")
        try:
            limits_before = bench_floors.measure_apart()    # its buffers are not this run's memory
        except RuntimeError as e:                           # then only after the run, and said so
            before_error = f"{e}; the limits were measured after the run only"
            if log:
                log(before_error)
    shapes: list = []
    result = {"engine": "qwen-npu", "workload": name, **run_workload(sess, work, shapes)}
    if log:
        log(f"{name}: {result['seconds']:.2f} s, {result['out_tok_s']:.1f} output tok/s")
    if probes:
        result["decode_ms_b1"], result["decode_host_ms_b1"] = decode_probe(sess, 1)
        result["decode_ms_b16"], result["decode_host_ms_b16"] = decode_probe(sess, cfg.max_batch)
        result["decode_host_share_b16"] = round(result["decode_host_ms_b16"] / result["decode_ms_b16"], 4)
        result["probe_context"], result["probe_batch"] = PROBE_CONTEXT, cfg.max_batch
    mem = sess.memory()
    result["memory"] = {"weights": mem.weights, "kv_cache": mem.kv_cache, "buffers": mem.buffers,
                        "before_load": rss_before_load, "rss_now": _rss_now()}
    result.update(peak_rss_bytes=_peak_rss(), load_s=round(load_s, 2), build_s=round(build_s, 2),
                  warmup_s=round(warmup_s, 2),
                  model=str(path), device=cfg.device, dtype=cfg.dtype, kernels=cfg.kernels,
                  prefix_cache=cfg.prefix_cache, mixed_steps=cfg.mixed_steps, threads=torch.get_num_threads(),
                  requests=len(work))
    if sess.model.device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(sess.model.device)
    if floors and sess.model.device.type == "cpu":
        if log:
            log("measuring the machine's limits again after the run")
        result.update(bench_floors.for_run(sess.model, result, shapes, batch=cfg.max_batch, before=limits_before))
        if before_error:
            result["floors"]["before_error"] = before_error
    device_used = cfg.device
    sess.close()
    if compare == "hf":
        from .bench_hf import run_hf_generate
        auto = result["floors"]["peer_dtype"] if "floors" in result else bench_floors.user_dtype(device_used)
        dtypes = peer_dtypes(peer_dtype, auto)
        runs = {}
        for dtype in dtypes:
            if log:
                log(f"running the same workload through Hugging Face generate in {dtype}")
            runs[dtype] = run_hf_generate(path, work, device=device_used, workload=name, dtype=dtype)
        result["hf"] = runs[dtypes[0]]
        result["hf_ratio"] = round(result["hf"]["seconds"] / result["seconds"], 2)
        if len(runs) > 1:
            result["hf_by_dtype"] = runs
    return result


# ---- command line ----------------------------------------------------------------------------------

def add_bench_parser(subparsers) -> None:
    """Register ``bench`` on the ``qwen-npu`` command's subparsers."""
    p = subparsers.add_parser("bench", help="time a shared workload (mixed, seed or custom lengths)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS),
                   help="shared workload (default: mixed, or custom when lengths are given)")
    p.add_argument("--model", help=f"checkpoint folder or Hugging Face repo id (default: {default_model_dir()}, made on first use)")
    p.add_argument("--compare", choices=["hf"], help="also run Hugging Face generate on the same work")
    p.add_argument("--peer-dtype", choices=PEER_DTYPES, default="auto",
                   help="Hugging Face's dtype: auto (float32 unless torch's bf16 products are the faster "
                        "here), float32, bfloat16 or both (default auto)")
    p.add_argument("--no-floors", action="store_true", help="skip measuring the machine's floors (CPU only)")
    p.add_argument("--json", action="store_true", help="print one compact JSON line instead of text")
    p.add_argument("--prompt-len", type=int, help="custom workload: tokens per prompt")
    p.add_argument("--output-len", type=int, help="custom workload: new tokens per request")
    p.add_argument("--num-requests", type=int, default=16, help="custom workload: requests (default 16)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | npu[:N]")
    p.add_argument("--kernels", default="auto", help="auto | reference | cpu | npu")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    p.add_argument("--mixed-steps", action="store_true",
                   help="decode rows and prefill chunks share steps (Session option mixed_steps)")
    p.add_argument("--no-probes", action="store_true", help="skip the batch-1 / batch-16 decode probes")
    p.set_defaults(handler=bench_command)


def bench_command(args) -> int:
    """Handler of ``qwen-npu bench``: prints the report (or one JSON line); returns the exit code."""
    custom = args.prompt_len is not None or args.output_len is not None
    if custom and args.workload:
        raise SystemExit("qwen-npu bench: give --workload or --prompt-len/--output-len, not both")
    if custom:
        if not (args.prompt_len and args.output_len and args.num_requests) or min(
                args.prompt_len, args.output_len, args.num_requests) < 1:
            raise SystemExit("qwen-npu bench: a custom workload needs --prompt-len, --output-len and "
                             "--num-requests, each >= 1")
        work = workloads.custom(args.prompt_len, args.output_len, n=args.num_requests)
    else:
        work = args.workload or "mixed"

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    options = dict(device=args.device, kernels=args.kernels, prefix_cache=not args.no_prefix_cache,
                   mixed_steps=args.mixed_steps)                       # SessionOptions fields
    try:
        result = run_bench(work, model=args.model, compare=args.compare, probes=not args.no_probes,
                           floors=not args.no_floors, peer_dtype=args.peer_dtype, log=log, **options)
    except InvalidRequestError as e:
        raise SystemExit(f"qwen-npu bench: {e}") from None
    print(json.dumps(result, separators=(",", ":")) if args.json else format_text(result), flush=True)
    return 0
