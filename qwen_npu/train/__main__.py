"""``python -m qwen_npu.train``: fetch WordNet (if needed) and train the small Qwen3.

    python -m qwen_npu.train --wordnet /tmp/wordnet --out qwen_npu/checkpoints/tiny-qwen3-wordnet

``--wordnet`` is a folder holding the unpacked Debian package ``wordnet-base``; when its data
files are missing they are fetched there with ``apt-get download wordnet-base`` and ``dpkg -x``.
"""
from __future__ import annotations

import argparse
import sys

from .corpus import fetch_wordnet
from .model import TinyShape
from .trainer import TrainConfig, train_tiny


def main(argv: list[str] | None = None) -> int:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m qwen_npu.train", description=__doc__.splitlines()[0])
    p.add_argument("--wordnet", required=True, help="folder with the unpacked wordnet-base package")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--copy-rows", type=int, default=d.copy_rows,
                   help="rows per batch made of random tokens repeated (teaches induction heads)")
    p.add_argument("--init", help="continue from this checkpoint (its weights and tokenizer)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--bf16-autocast", action="store_true", help="bf16 matmuls, fp32 weights")
    p.add_argument("--hidden-size", type=int, default=d.shape.hidden_size)
    p.add_argument("--layers", type=int, default=d.shape.num_hidden_layers)
    p.add_argument("--intermediate-size", type=int, default=d.shape.intermediate_size)
    p.add_argument("--vocab-size", type=int, default=d.shape.vocab_size)
    a = p.parse_args(argv)
    shape = TinyShape(vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_hidden_layers=a.layers,
                      intermediate_size=a.intermediate_size,
                      head_dim=a.hidden_size // TinyShape.num_attention_heads)
    cfg = TrainConfig(seed=a.seed, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len,
                      copy_rows=a.copy_rows, init=a.init, lr=a.lr, warmup_steps=a.warmup_steps,
                      threads=a.threads, bf16_autocast=a.bf16_autocast, shape=shape)
    fetch_wordnet(a.wordnet)
    train_tiny(a.wordnet, a.out, cfg, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
