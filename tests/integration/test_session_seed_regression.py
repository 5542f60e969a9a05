"""The regression the toolkit was born from, scaled down: 16 identical long prompts decoded together.

A fixed-batch runner once turned such streams into zeros. Here all 16 streams must be identical,
equal to the same prompt run alone, and no row's logits may be all zero or non-finite at any step.
"""
import pytest
import torch

from session_kit import MARGIN, greedy, make_untied, open_session, prompts, run_to_end, top2_margins

CHUNK = 8
PROMPT_LEN = 3 * CHUNK + 5          # longer than 3 chunks
NEW_TOKENS = 8
ROWS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("seed_regression"))


def healthy_rows(seen: list):
    """A ``check`` for ``run_to_end``: every logits row finite and not all zero; records steps."""
    def check(step):
        logits = step.logits.tensor                                      # [rows, vocab]
        finite = torch.isfinite(logits).all(dim=-1)
        nonzero = (logits != 0).any(dim=-1)
        assert finite.all(), f"step {step.index}: non-finite logits in rows {(~finite).nonzero().flatten().tolist()}"
        assert nonzero.all(), f"step {step.index}: all-zero logits in rows {(~nonzero).nonzero().flatten().tolist()}"
        seen.append((step.kind, step.logits_request_ids, top2_margins(logits)))
    return check


def open_seed_session(ckpt):
    return open_session(ckpt, max_batch=ROWS, chunk_size=CHUNK, prefix_cache=False, block_size=4,
                        max_model_len=64, num_blocks=ROWS * 16)


def test_sixteen_identical_long_prompts(ckpt):
    prompt = prompts((PROMPT_LEN,), seed=3)[0]

    alone = open_seed_session(ckpt)
    solo = alone.add_request(prompt, greedy(NEW_TOKENS))
    solo_seen = []
    run_to_end(alone, healthy_rows(solo_seen))
    margins = torch.cat([m for _, _, m in solo_seen])
    assert (margins >= MARGIN).all(), f"alone run: top-2 margins {margins.tolist()} too small to compare tokens"
    assert len(solo.output_token_ids) == NEW_TOKENS

    sess = open_seed_session(ckpt)
    reqs = [sess.add_request(prompt, greedy(NEW_TOKENS)) for _ in range(ROWS)]
    seen = []
    steps = run_to_end(sess, healthy_rows(seen))

    prefills = [s for s in steps if s.kind == "prefill"]
    decodes = [s for s in steps if s.kind == "decode"]
    assert len(prefills) >= ROWS * PROMPT_LEN // CHUNK                  # chunked, no prefix sharing
    assert all(int(s.query_lens.sum()) <= CHUNK for s in prefills)
    assert sum(int(s.query_lens.sum()) for s in prefills) == ROWS * PROMPT_LEN
    assert decodes and all(s.batch_size == ROWS for s in decodes)
    assert all(not s.health for s in steps)
    assert sum(len(ids) for _, ids, _ in seen) == ROWS * NEW_TOKENS

    streams = [r.output_token_ids for r in reqs]
    same = sum(s == solo.output_token_ids for s in streams)
    assert same == ROWS, f"{same}/{ROWS} streams equal the prompt run alone: {streams} vs {solo.output_token_ids}"
    assert all(r.finish_reason == "length" for r in reqs)


def test_sixteen_rows_logits_match_the_single_row(ckpt):
    """Every decode row's logits equal the lone request's logits at the same position."""
    prompt = prompts((PROMPT_LEN,), seed=3)[0]
    alone = open_seed_session(ckpt)
    alone.add_request(prompt, greedy(3))
    solo = []
    run_to_end(alone, lambda s: solo.append(s.logits.tensor.clone()))

    sess = open_seed_session(ckpt)
    for _ in range(ROWS):
        sess.add_request(prompt, greedy(3))
    rows = []
    run_to_end(sess, lambda s: rows.append(s.logits.tensor.clone()))
    # the prefill logits arrive over several steps; the decode steps carry all 16 rows
    batched = torch.cat(rows[:-2])                                       # [16, vocab] from prefill
    assert batched.shape[0] == ROWS
    torch.testing.assert_close(batched, solo[0].expand(ROWS, -1), atol=1e-4, rtol=0)
    for got, ref in zip(rows[-2:], solo[1:]):
        assert got.shape[0] == ROWS
        torch.testing.assert_close(got, ref.expand(ROWS, -1), atol=1e-4, rtol=0)
