"""Train the small Qwen3 from a seed: corpus -> tokenizer -> token streams -> AdamW -> checkpoint.

Everything random (paragraph order, chat samples, initial weights, batch windows) comes from
``seed``, so the same seed, torch version and thread count give the same weights.
``train_tiny`` writes a complete checkpoint folder (weights, config, tokenizer, chat template) and
a ``training_report.json`` with the numbers measured on the held-out split.

With ``init`` set, training continues from a checkpoint this script wrote (its weights and its
tokenizer; a fresh optimiser and learning-rate schedule), which is how the shipped model got its
induction head: a text-only stage, then a stage with copy rows (``data.Batches``). The report
keeps the earlier stages' figures under ``stages``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import data, evaluate
from .card import wordnet_licence, write_model_card
from .corpus import load_corpus
from .model import TinyShape, build_model, config_dict, load_model, num_parameters, save_checkpoint
from .tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, qwen3_chat_template, save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 2000
    batch_size: int = 8
    copy_rows: int = 0            # rows per batch that repeat random tokens (see data.Batches)
    copy_len: tuple[int, int] = (6, 32)
    init: str | None = None       # continue from this checkpoint (weights and tokenizer)
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 1             # on shared cores one thread beats two by a wide margin
    bf16_autocast: bool = False  # bf16 matmuls (fp32 weights): faster on CPUs with AVX-512 BF16
    eval_windows: int = 256
    shape: TinyShape = field(default_factory=TinyShape)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@contextlib.contextmanager
def staged_folder(out: Path):
    """A fresh sibling folder to write into; on success it replaces ``out`` (whatever was there),
    on any error or interrupt it is removed and ``out`` is left as it was."""
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f"{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def train_tiny(wordnet_dir: str | Path, out_dir: str | Path, cfg: TrainConfig = TrainConfig(),
               log=print) -> dict:
    """Train on the WordNet data under ``wordnet_dir``; write the checkpoint to ``out_dir``."""
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    corpus = load_corpus(wordnet_dir, seed=cfg.seed)
    train_texts = data.with_chats(corpus.train, cfg.seed)
    log(f"corpus: {len(corpus.train)} train / {len(corpus.val)} held-out paragraphs, "
        f"{corpus.num_bytes / 1e6:.1f} MB, from {corpus.source}")

    earlier = None
    if cfg.init:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(cfg.init) / "tokenizer.json"))
        earlier = json.loads((Path(cfg.init) / "training_report.json").read_text())
    else:
        tok = train_tokenizer(train_texts, vocab_size=cfg.shape.vocab_size)
    pad_id, eos_id = tok.token_to_id(PAD_TOKEN), tok.token_to_id(EOS_TOKEN)
    train_stream = data.token_stream(tok, train_texts, pad_id)
    val_stream = data.token_stream(tok, corpus.val, pad_id)
    log(f"tokens: {train_stream.numel()} train, {val_stream.numel()} held-out "
        f"({time.perf_counter() - t_start:.0f} s)")

    config = config_dict(cfg.shape, pad_id=pad_id, eos_id=eos_id)
    windows = data.eval_windows(val_stream, cfg.seq_len, cfg.eval_windows)
    if earlier is None:
        model = build_model(config, cfg.seed)
        untrained = start_loss = evaluate.model_loss(model, windows)
    else:
        model, config = load_model(cfg.init)
        untrained, start_loss = earlier["held_out_loss"]["untrained"], evaluate.model_loss(model, windows)
    vocab = config["vocab_size"]
    unigram = evaluate.unigram_loss(train_stream, windows, vocab)
    probe = dict(pad_id=pad_id, first_id=len(SPECIAL_TOKENS), vocab_size=vocab)
    log(f"{num_parameters(model)} parameters; held-out loss at the start {start_loss:.3f}, "
        f"untrained {untrained:.3f}, unigram {unigram:.3f}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    batches = data.Batches(train_stream, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                           copy_rows=cfg.copy_rows, copy_ids=(len(SPECIAL_TOKENS), vocab), copy_len=cfg.copy_len)
    model.train()
    t_train = time.perf_counter()
    running = None
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        inputs, targets = batches.next()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), ignore_index=data.IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == cfg.steps - 1:
            elapsed = time.perf_counter() - t_train
            log(f"step {step:5d}  loss {running:.3f}  lr {learning_rate(cfg, step):.2e}  "
                f"{(step + 1) * cfg.batch_size * cfg.seq_len / elapsed:.0f} tokens/s  {elapsed:.0f} s")
        if cfg.copy_rows and step % 500 == 0:
            ind = evaluate.induction(model, **probe)["induction"]
            log(f"           best induction head: layer {ind['layer']} head {ind['head']} score {ind['score']:.2f}")
    train_seconds = time.perf_counter() - t_train
    val = evaluate.model_loss(model, windows)
    heads = evaluate.induction(model, **probe)

    report = {
        "corpus": {"source": "WordNet 3.0 (Debian package wordnet-base)", "licence": "WordNet 3.0 licence",
                   "bytes": corpus.num_bytes, "train_paragraphs": len(corpus.train),
                   "held_out_paragraphs": len(corpus.val), "train_tokens": int(train_stream.numel()),
                   "held_out_tokens_scored": int(windows[:, 1:].numel())},
        "parameters": num_parameters(model),
        "held_out_loss": {"trained": val, "untrained": untrained, "unigram": unigram},
        "held_out_perplexity": {k: evaluate.perplexity(v) for k, v in
                                (("trained", val), ("untrained", untrained), ("unigram", unigram))},
        "heads": heads,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "config": {k: v for k, v in asdict(cfg).items() if k != "shape"},
        "torch": torch.__version__,
    }
    if earlier is not None:
        stages = earlier.pop("stages", [])
        report["held_out_loss"]["start_of_stage"] = start_loss
        report["stages"] = [*stages, earlier]
        report["train_seconds_all_stages"] = round(sum(st["train_seconds"] for st in report["stages"])
                                                   + train_seconds, 1)
    out = Path(out_dir)
    with staged_folder(out) as tmp:
        save_checkpoint(model, config, tmp, eos_ids=[eos_id, pad_id], pad_id=pad_id)
        save_tokenizer(tok, tmp, qwen3_chat_template())
        (tmp / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_model_card(tmp, report, wordnet_licence(corpus.source))
    ind = heads["induction"]
    log(f"held-out loss {val:.3f} (perplexity {math.exp(val):.1f}); untrained {untrained:.3f}, "
        f"unigram {unigram:.3f}; best induction head: layer {ind['layer']} head {ind['head']} "
        f"score {ind['score']:.2f}; {train_seconds:.0f} s of training; wrote {out}")
    return report
