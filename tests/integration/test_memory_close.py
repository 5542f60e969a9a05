"""KV memory budgets, the memory report, and close() / the context manager giving memory back."""
import gc
import html
import weakref

import pytest

from qwen_npu import InvalidRequestError, SamplingParams, Session, StaleOutputError
from qwen_npu.session import memory
from qwen_npu.cache.kv_cache import bytes_per_block

ARGS = dict(device="cpu", max_batch=2, block_size=4, max_model_len=64)


def block_bytes(sess):
    mc = sess.model_config
    return bytes_per_block(mc.num_hidden_layers, sess.config.block_size, mc.num_key_value_heads, mc.head_dim,
                           sess.model.dtype)


@pytest.mark.parametrize("spec, budget", [("64KiB", 64 << 10), ("100kB", 100_000), (50_000, 50_000),
                                          ("0.25 MiB", 1 << 18)])
def test_kv_memory_budget_sizes_num_blocks(tiny_ckpt_small_vocab, spec, budget):
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, kv_memory=spec, **ARGS)
    per = block_bytes(sess)
    assert sess.config.num_blocks == budget // per
    assert sess._engine.kv_cache.nbytes <= budget < sess._engine.kv_cache.nbytes + per
    report = sess.memory()
    assert report.kv_cache == sess._engine.kv_cache.nbytes and report.num_blocks == budget // per


def test_kv_memory_fraction_of_available_memory(tiny_ckpt_small_vocab, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000_000)
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, kv_memory=0.01, **ARGS)
    assert sess.config.num_blocks == 100_000 // block_bytes(sess)


@pytest.mark.parametrize("kw, why", [
    ({"kv_memory": "1GiB", "num_blocks": 8}, "not both"), ({"kv_memory": "lots"}, "kv_memory='lots'"),
    ({"kv_memory": 1.5}, "fraction"), ({"kv_memory": 0}, "at least 1 byte"),
    ({"kv_memory": "10B"}, "less than one KV block"),
])
def test_bad_budgets_are_refused(tiny_ckpt_small_vocab, kw, why):
    with pytest.raises(InvalidRequestError, match=why):
        Session.from_pretrained(tiny_ckpt_small_vocab, **{**ARGS, **kw})


def test_memory_report_tracks_used_cached_and_free_blocks(tiny_ckpt_small_vocab):
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, num_blocks=32, **ARGS)
    empty = sess.memory()
    assert (empty.used_blocks, empty.cached_blocks, empty.free_blocks) == (0, 0, 32)
    assert empty.largest_request == empty.fits_now == 64              # max_model_len caps 32 * 4 slots
    assert empty.weights == expected_weight_bytes(sess)
    assert empty.buffers > 0 and empty.total == empty.weights + empty.kv_cache + empty.buffers
    req = sess.add_request(list(range(1, 10)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    sess.step()
    mid = sess.memory()
    assert mid.used_blocks == len(req.block_table) == 3 and mid.free_blocks == 29
    while not req.is_done:
        sess.step()
    done = sess.memory()
    assert done.used_blocks == 0 and done.cached_blocks == 3 and done.cached_blocks + done.free_blocks == 32
    assert "KV cache" in repr(done) and "<table>" in done._repr_html_()


def test_close_frees_tensors_and_later_calls_say_so(tiny_ckpt_small_vocab):
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, num_blocks=32, **ARGS)
    sess.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), progress=False)
    step = sess.last_step
    refs = held_tensors(sess)
    sess.close()
    gc.collect()
    assert sess.closed and all(r() is None for r in refs)
    with pytest.raises(StaleOutputError):
        _ = step.logits.tensor
    for call in (lambda: sess.add_request([1, 2]), sess.step, sess.memory, lambda: sess.generate([[1]])):
        with pytest.raises(InvalidRequestError, match="session is closed"):
            call()
    assert "closed" in repr(sess) and sess._repr_html_() == f"<div>{html.escape(repr(sess))}</div>"
    sess.close()                                   # idempotent


def test_context_manager_frees_on_error(tiny_ckpt_small_vocab):
    with pytest.raises(RuntimeError, match="boom"), \
            Session.from_pretrained(tiny_ckpt_small_vocab, num_blocks=32, **ARGS) as sess:
        sess.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), progress=False)
        refs = held_tensors(sess)
        raise RuntimeError("boom")
    gc.collect()
    assert sess.closed and all(r() is None for r in refs)


def held_tensors(sess):
    """Weak references to the big tensors: KV blocks, dispatch/output buffers, weights."""
    tensors = sess._engine.kv_cache.keys + sess._engine.kv_cache.values + list(sess.buffers.values())
    tensors += [t for t in memory.model_tensors(sess.model) if t is not None]
    return [weakref.ref(t) for t in tensors]


def expected_weight_bytes(sess):
    """fp32 parameters of a tied Qwen3 from its config, plus the RoPE cos/sin tables."""
    c = sess.model_config
    q, kv, h, i = c.q_size, c.kv_size, c.hidden_size, c.intermediate_size
    layer = 2 * h + (q + 2 * kv) * h + 2 * c.head_dim + q * h + 2 * i * h + i * h
    assert c.tie_word_embeddings
    params = c.vocab_size * h + h + c.num_hidden_layers * layer
    return 4 * params + 2 * 4 * sess.config.max_model_len * c.head_dim


def test_closing_a_session_closes_its_forks(tiny_ckpt_small_vocab):
    sess = Session.from_pretrained(tiny_ckpt_small_vocab, num_blocks=32, **ARGS)
    sess.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    sess.step()
    child = sess.fork()
    refs = held_tensors(sess)
    sess.close()
    gc.collect()
    assert child.closed and all(r() is None for r in refs)
    with pytest.raises(InvalidRequestError, match="session is closed"):
        child.step()
