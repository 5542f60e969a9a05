"""Our paged engine against the dense Hugging Face forward on the same checkpoint (float32)."""
import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

TOL = 1e-4
PROMPT_LENS = (7, 13, 21)
DECODE_POSITIONS = 32


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {
        "default": make_tiny_qwen3(root / "default", vocab_size=512, seed=1),
        # head_dim != hidden / heads, a single KV head, untied embeddings
        "odd": make_tiny_qwen3(root / "odd", vocab_size=384, seed=2, hidden_size=48, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=24, intermediate_size=96,
                               tie_word_embeddings=False, num_hidden_layers=3),
    }


def sequences(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n + DECODE_POSITIONS,), generator=g).tolist() for n in PROMPT_LENS]


def paged_logits(path, seqs, block_size, chunk_size):
    """Logits of every position from the prompt end onward, teacher-forced through the Session."""
    sess = Session.from_pretrained(path, block_size=block_size, chunk_size=chunk_size, max_batch=4,
                                   num_blocks=200, max_model_len=128)
    reqs = [sess.add_request(s[:n], SamplingParams(max_new_tokens=DECODE_POSITIONS + 1, ignore_eos=True))
            for s, n in zip(seqs, PROMPT_LENS)]
    got = {r.id: {} for r in reqs}
    by_id = {r.id: (r, s) for r, s in zip(reqs, seqs)}
    for _ in range(10_000):
        if all(len(r.output_token_ids) >= DECODE_POSITIONS for r in reqs):
            break
        pending = [r for r in reqs if r.status in ("waiting", "prefilling")]
        step = sess.prefill() if pending else sess.decode_step()
        if step.logits is None:
            continue
        rows = step.logits.tensor.clone()
        force = {}
        for i, rid in enumerate(step.logits_request_ids):
            r, s = by_id[rid]
            pos = r.num_tokens - 1
            got[rid][pos] = rows[i]
            force[rid] = s[pos + 1]
        sess.sample(step, force=force)
    return got


def dense_logits(path, seqs):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


@pytest.mark.parametrize("shape", ["default", "odd"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("chunk_size", [1, 5, 512])
def test_paged_logits_match_dense_hf(shapes, shape, block_size, chunk_size):
    path = shapes[shape]
    cfg = __import__("json").loads((path / "config.json").read_text())
    seqs = sequences(cfg["vocab_size"])
    ref = dense_logits(path, seqs)
    got = paged_logits(path, seqs, block_size, chunk_size)
    worst = 0.0
    n = 0
    for (rid, rows), s, dense, plen in zip(got.items(), seqs, ref, PROMPT_LENS):
        assert sorted(rows) == list(range(plen - 1, plen - 1 + DECODE_POSITIONS))
        for pos, row in rows.items():
            worst = max(worst, (row - dense[pos]).abs().max().item())
            n += 1
    print(f"parity {shape} block_size={block_size} chunk_size={chunk_size}: {n} rows, max|diff|={worst:.2e}")
    assert worst <= TOL


def mixed_step_logits(path, prompts, block_size, chunk_size):
    """Greedy runs with mixed steps: request 0 first, the others while it decodes. Returns
    (logits by request and position, final token lists, the kinds of the steps)."""
    sess = Session.from_pretrained(path, block_size=block_size, chunk_size=chunk_size, max_batch=4,
                                   num_blocks=200, max_model_len=128, mixed_steps=True)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [sess.add_request(prompts[0], sampling)]
    got, kinds = {}, []
    for i in range(10_000):
        if i == 2:
            reqs += [sess.add_request(p, sampling) for p in prompts[1:]]
        if i > 2 and all(r.is_done for r in reqs):
            break
        step = sess.step()
        kinds.append(step.kind)
        if step.logits is None:
            continue
        rows = step.logits.tensor.clone()
        for j, rid in enumerate(step.logits_request_ids):
            pos = sess.request(rid).num_tokens - 2       # the row's last position (step() sampled one more)
            got.setdefault(rid, {})[pos] = rows[j]
    return got, [r.all_token_ids for r in reqs], kinds


@pytest.mark.parametrize("shape", ["default", "odd"])
@pytest.mark.parametrize("chunk_size", [4, 512])
def test_mixed_step_logits_match_dense_hf(shapes, shape, chunk_size):
    path = shapes[shape]
    cfg = __import__("json").loads((path / "config.json").read_text())
    prompts = [s[:n] for s, n in zip(sequences(cfg["vocab_size"]), PROMPT_LENS)]
    got, seqs, kinds = mixed_step_logits(path, prompts, 3, chunk_size)
    assert "mixed" in kinds
    ref = dense_logits(path, seqs)
    worst, n = 0.0, 0
    for rid, (seq, dense) in enumerate(zip(seqs, ref)):
        plen = len(prompts[rid])
        assert sorted(got[rid]) == list(range(plen - 1, len(seq) - 1))
        for pos, row in got[rid].items():
            worst = max(worst, (row - dense[pos]).abs().max().item())
            n += 1
    print(f"parity through mixed steps {shape} chunk_size={chunk_size}: {n} rows, max|diff|={worst:.2e}")
    assert worst <= TOL
