"""The benchmark workloads: lists of (prompt token ids, new tokens to generate).

Generated here from a seed with Python's ``random.Random``, token for token the same lists that
other engines are given when they are compared with ``qwen-npu bench``, so every engine does
exactly the same work. Greedy decoding, EOS ignored: a request always produces its full count.

    mixed   32 requests, prompts of 64..512 tokens, 32..128 new tokens each (continuous batching)
    seed    16 copies of one 512-token prompt, 64 new tokens each (a shared prefix, batch 16)
    custom  n requests of one prompt length and one output length
"""
from __future__ import annotations

import random

# token ids are drawn from [TOKEN_LOW, TOKEN_HIGH): clear of the special tokens at both ends
TOKEN_LOW, TOKEN_HIGH = 100, 151000

Workload = list[tuple[list[int], int]]


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)]


def mixed(n: int = 32, seed: int = 0, prompt_len: tuple[int, int] = (64, 512),
          output_len: tuple[int, int] = (32, 128)) -> Workload:
    """``n`` requests; per request, in this order: a prompt length and an output length drawn
    uniformly from the inclusive ranges, then the prompt's tokens."""
    rng = random.Random(seed)
    work: Workload = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        new_tokens = rng.randint(*output_len)
        work.append((_prompt(rng, length), new_tokens))
    return work


def seed_like(n: int = 16, prompt_len: int = 512, output_len: int = 64, seed: int = 1) -> Workload:
    """``n`` identical prompts (one draw, copied), each generating ``output_len`` tokens."""
    prompt = _prompt(random.Random(seed), prompt_len)
    return [(prompt.copy(), output_len) for _ in range(n)]


def custom(prompt_len: int, output_len: int, n: int = 16, seed: int = 2) -> Workload:
    """``n`` distinct random prompts of ``prompt_len`` tokens, ``output_len`` new tokens each."""
    rng = random.Random(seed)
    return [(_prompt(rng, prompt_len), output_len) for _ in range(n)]


WORKLOADS = {"mixed": mixed, "seed": seed_like}


def get_workload(name: str) -> Workload:
    """The named shared workload with its default arguments."""
    try:
        return WORKLOADS[name]()
    except KeyError:
        from ..errors import InvalidRequestError
        raise InvalidRequestError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


def summary(work: Workload) -> dict:
    """Counts that describe a workload: requests, prompt tokens, output tokens."""
    return {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(n for _, n in work)}
