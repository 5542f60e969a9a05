"""Greedy streams of a batch of mixed-length prompts equal Hugging Face's greedy ``generate``."""
import pytest
import torch

from session_kit import MARGIN, PROMPT_LENS, greedy, make_untied, open_session, prompts, top2_margins

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("hf_greedy"))


@pytest.fixture(scope="module")
def hf_streams(ckpt):
    """Per prompt: (greedy tokens, top-2 margin of each step's raw logits), one prompt at a time."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    eos = model.config.vocab_size - 1
    # min_new_tokens keeps eos from ending a stream early; the raw logits show it was never the pick
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              eos_token_id=eos, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
    out = []
    for p in prompts():
        ids = torch.tensor([p])
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = res.sequences[0, len(p):].tolist()
        raw = torch.stack(res.logits)[:, 0]                              # [new tokens, vocab]
        assert len(tokens) == NEW_TOKENS
        assert raw.argmax(-1).tolist() == tokens, "eos suppression changed a Hugging Face token"
        out.append((tokens, top2_margins(raw)))
    return out


@pytest.mark.parametrize("chunk_size", [4, 512], ids=["chunked", "unchunked"])
def test_batched_greedy_equals_hf_generate(ckpt, hf_streams, chunk_size):
    assert chunk_size >= 512 or chunk_size < min(PROMPT_LENS)
    sess = open_session(ckpt, chunk_size=chunk_size, max_batch=len(PROMPT_LENS))
    outs = sess.generate(prompts(), greedy(NEW_TOKENS), progress=False)
    if chunk_size < 512:
        prefills = [s for s in sess.history if s.kind == "prefill"]
        assert len(prefills) >= -(-sum(PROMPT_LENS) // chunk_size) and len(prefills) > 1
        assert all(int(s.query_lens.sum()) <= chunk_size for s in prefills)
    for i, (out, (ref, margins)) in enumerate(zip(outs, hf_streams)):
        low = (margins < MARGIN).nonzero().flatten().tolist()
        assert not low, f"prompt {i}: reference top-2 margin below {MARGIN} at steps {low}: {margins[low]}"
        assert list(out.token_ids) == ref, f"prompt {i} (len {PROMPT_LENS[i]}) differs from transformers"
        assert out.finish_reason == "length"


def test_all_prompts_share_decode_steps(ckpt):
    """The mixed-length prompts really ran as one batch: decode steps carry every request."""
    sess = open_session(ckpt, chunk_size=512, max_batch=len(PROMPT_LENS))
    sess.generate(prompts(), greedy(4), progress=False)
    decodes = [s for s in sess.history if s.kind == "decode"]
    assert decodes and all(s.batch_size == len(PROMPT_LENS) for s in decodes)
    prefill = sess.history[0]
    assert prefill.kind == "prefill" and prefill.query_lens.tolist() == list(PROMPT_LENS)
