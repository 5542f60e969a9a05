"""Runtime-batch decode: with n active rows, only prefix views [:n] reach the model and kernels.

Observed at the boundary: a recording stand-in for the kernel module and a recording wrapper
around the model's forward see every batch-shaped argument of the step.
"""
import pytest
import torch

from qwen_npu import SlotCollisionError
from qwen_npu.model.qwen3 import Qwen3Model
from session_kit import greedy, open_session, prompts, state

CAPACITY = 16
KEEP = (2, 7, 13)            # the requests left running; the other 13 are aborted
SENTINEL_INT = -77
SENTINEL_FLOAT = 123.25

# per kernel: the positions of its batch-shaped tensor arguments (weights and caches are not)
BATCH_ARGS = {"write_kv": (0, 1, 4), "paged_attention": (0,), "rms_norm": (0,), "add_rms_norm": (0, 1),
              "rope": (0, 1, 2, 3)}
META_FIELDS = ("positions", "slot_mapping", "block_tables", "seq_lens")


class RecordingKernels:
    """Forwards every kernel call to ``inner`` and records the leading size of its batch arguments."""

    def __init__(self, inner):
        self._inner = inner
        self.sizes: list[tuple[str, int]] = []          # (argument, leading size)

    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if name not in BATCH_ARGS:
            return fn

        def call(*args, **kwargs):
            for i in BATCH_ARGS[name]:
                self.sizes.append((f"{name}[{i}]", args[i].shape[0]))
            if name == "paged_attention":
                meta = args[3]
                for field in META_FIELDS:
                    self.sizes.append((f"meta.{field}", getattr(meta, field).shape[0]))
                self.sizes.append(("meta.query_start_loc - 1", meta.query_start_loc.shape[0] - 1))
                self.sizes.append(("meta.query_lens_host", len(meta.query_lens_host)))
            return fn(*args, **kwargs)
        return call


@pytest.fixture
def recorder(monkeypatch):
    """Record the model's forward arguments (and its kernels') for every Session in the test."""
    calls = []
    forward = Qwen3Model.forward

    def recording_forward(model, input_ids, meta, kv_caches, logits_index, **kw):
        calls.append(dict(input_ids=input_ids, logits_index=logits_index, logits_out=kw.get("logits_out"),
                          hidden_out=kw.get("hidden_out")))
        return forward(model, input_ids, meta, kv_caches, logits_index, **kw)

    monkeypatch.setattr(Qwen3Model, "__call__", recording_forward)
    return calls


def sixteen_decoding(path, **kw):
    """A session with 16 requests admitted, prefilled and sampled, then 13 of them aborted."""
    sess = open_session(path, max_batch=CAPACITY, max_model_len=32, block_size=4, **kw)
    lens = [3 + i % 5 for i in range(CAPACITY)]
    reqs = [sess.add_request(p, greedy(6)) for p in prompts(lens, seed=1)]
    sess.sample(sess.prefill())
    assert all(r.status == "decoding" for r in reqs)
    for r in reqs:
        if r.id not in KEEP:
            sess.abort(r)
    return sess, reqs


def poison_inactive_rows(sess, active: int) -> dict[str, torch.Tensor]:
    """Write a sentinel into rows [active:] of every decode buffer; returns their snapshots."""
    before = {}
    for name, buf in sess.buffers.items():
        if name.startswith("prefill."):
            continue
        start = active + 1 if name == "query_start_loc" else active
        buf[start:] = SENTINEL_FLOAT if buf.is_floating_point() else SENTINEL_INT
        before[name] = buf.clone()
    return before


def assert_inactive_rows_unchanged(sess, before: dict, active: int, when: str):
    for name, snap in before.items():
        start = active + 1 if name == "query_start_loc" else active
        now = sess.buffers[name]
        assert torch.equal(now[start:], snap[start:]), f"{when}: inactive rows of buffer {name!r} changed"


def test_decode_set_is_at_capacity(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, max_batch=CAPACITY, max_model_len=32)
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables", "logits", "hidden"):
        assert sess.buffers[name].shape[0] == CAPACITY, name
    assert sess.buffers["logits"].shape[1] == sess.model_config.vocab_size
    with pytest.raises(TypeError):
        sess.buffers["logits"] = torch.zeros(1)


def test_three_of_sixteen_rows_dispatch_three(tiny_ckpt_small_vocab, recorder, monkeypatch):
    sess, reqs = sixteen_decoding(tiny_ckpt_small_vocab)
    kernels = RecordingKernels(sess.model.kernels)
    monkeypatch.setattr(sess.model, "kernels", kernels)
    n = len(KEEP)
    for _ in range(2):                     # the second step also finds the buffers as the first left them
        before = poison_inactive_rows(sess, n)
        recorder.clear()
        kernels.sizes.clear()
        step = sess.decode_step()
        assert_inactive_rows_unchanged(sess, before, n, f"after decode step {step.index}")

        assert step.batch_size == n and step.request_ids == list(KEEP)
        assert len(recorder) == 1
        call = recorder[0]
        for arg in ("input_ids", "logits_index", "logits_out", "hidden_out"):
            assert call[arg].shape[0] == n, f"model argument {arg} has leading size {call[arg].shape[0]}"
        # the outputs are written in place into prefix views of the capacity buffers
        tail = "" if step.logits.tensor.data_ptr() == sess.buffers["logits"].data_ptr() else ".1"
        assert call["logits_out"].data_ptr() == sess.buffers["logits" + tail].data_ptr()
        assert call["hidden_out"].data_ptr() == sess.buffers["hidden" + tail].data_ptr()
        assert kernels.sizes, "the kernels were not called through the model's kernel set"
        wrong = [(arg, size) for arg, size in kernels.sizes if size != n]
        assert not wrong, f"kernel arguments not of leading size {n}: {wrong[:8]}"
        assert {a for a, _ in kernels.sizes} >= {"write_kv[4]", "paged_attention[0]", "meta.block_tables",
                                                  "meta.seq_lens", "meta.positions", "meta.slot_mapping"}

        assert step.logits.shape == (n, sess.model_config.vocab_size)
        assert step.logits_request_ids == list(KEEP)
        sess.sample(step)
        assert_inactive_rows_unchanged(sess, before, n, f"after sampling step {step.index}")
    assert all(len(r.output_token_ids) == 3 for r in reqs if r.id in KEEP)


def test_runtime_rows_follow_the_active_requests(tiny_ckpt_small_vocab):
    """Rows hold exactly the active requests' next tokens, positions, slots and block tables."""
    sess, reqs = sixteen_decoding(tiny_ckpt_small_vocab)
    step = sess.decode_step()
    live = [sess.request(i) for i in KEEP]
    n = len(live)
    assert step.input_ids.tolist() == [r.all_token_ids[-1] for r in live]
    assert step.positions.tolist() == [r.num_tokens - 1 for r in live]
    assert step.seq_lens.tolist() == [r.num_tokens for r in live]
    bs = sess.config.block_size
    slots = [r.block_table[(r.num_tokens - 1) // bs] * bs + (r.num_tokens - 1) % bs for r in live]
    assert step.slot_mapping.tolist() == slots
    assert sess.buffers["slot_mapping"][:n].tolist() == slots
    assert sess.buffers["input_ids"][:n].tolist() == step.input_ids.tolist()
    for row, r in enumerate(live):
        table = sess.buffers["block_tables"][row].tolist()
        assert table[:len(r.block_table)] == r.block_table
        assert all(b == -1 for b in table[len(r.block_table):])


def test_replicate_padding_dispatches_every_row(tiny_ckpt_small_vocab, recorder, monkeypatch):
    sess, reqs = sixteen_decoding(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    kernels = RecordingKernels(sess.model.kernels)
    monkeypatch.setattr(sess.model, "kernels", kernels)
    recorder.clear()
    step = sess.decode_step()
    assert len(recorder) == 1
    assert step.batch_size == CAPACITY and step.num_active == len(KEEP)
    assert step.request_ids[:len(KEEP)] == list(KEEP)
    # padding rows copy row 0: its token, position, slot, sequence length and block table
    pad = slice(len(KEEP), None)
    for field in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        values = getattr(step, field)
        assert (values[pad] == values[0]).all(), f"padding rows of {field} do not copy row 0"
    assert (step.block_tables[pad] == step.block_tables[0]).all()
    assert recorder[0]["input_ids"].shape[0] == CAPACITY
    assert recorder[0]["logits_out"].shape[0] == CAPACITY
    wrong = [(arg, size) for arg, size in kernels.sizes if size != CAPACITY]
    assert not wrong, f"replicate padding dispatched fewer rows: {wrong[:8]}"
    # only the real requests' rows are exposed and sampled
    assert step.logits_request_ids == list(KEEP) and step.logits.shape[0] == len(KEEP)
    sess.sample(step)

    runtime, _ = sixteen_decoding(tiny_ckpt_small_vocab)
    ref = runtime.decode_step()
    runtime.sample(ref)
    assert step.token_ids.tolist() == ref.token_ids.tolist()


def test_replicate_padding_is_refused_by_the_slot_check(tiny_ckpt_small_vocab):
    sess, _ = sixteen_decoding(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="raise")
    before = state(sess)
    with pytest.raises(SlotCollisionError):
        sess.decode_step()
    assert state(sess) == before
    with pytest.warns(Warning):
        warned, _ = sixteen_decoding(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="warn")
        warned.decode_step()
