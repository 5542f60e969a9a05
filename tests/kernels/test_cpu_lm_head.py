"""The LM head with greedy sampling's read fused (``cpu.lm_head``, csrc/greedy.h): the logits it
writes are the bits of ``out.copy_(linear(x, w))`` and its (argmax, health code) per row are those
of a separate read of them, for ordinary rows and for every kind of broken row, on AMX tiles and on
16-column panels, at one and two threads; what it cannot take it leaves alone; a hook's edit of
the logits is what gets sampled (a Session with and without it: tests/kernels/test_cpu_fused.py)."""
from __future__ import annotations

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import cpu, onednn, panels, reference
from qwen_npu.testing import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")

AMX = cpu.available() and cpu.amx() and cpu.native_bf16() and cpu.bf16_dot() and cpu.ops().has_amx_linear()
FORMS = ["panels", pytest.param("amx", marks=pytest.mark.skipif(not AMX, reason="no AMX tiles here"))]


def held(w: torch.Tensor, form: str) -> torch.Tensor:
    return panels.pack(w) if form == "panels" else onednn.prepare_weight(w)


def cases(n: int, k: int, rows: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, x [rows, k] bf16, w [n, k] bf16): ordinary rows, and rows of each broken kind."""
    gen = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    out = [("ordinary", x, w)]
    tie = w.clone()
    tie[3] = tie[n - 5] = (x[0].float() * 0.5).bfloat16()       # row 0's maximum twice, far apart
    out.append(("tied maxima", x, tie))
    nan = w.clone()
    nan[7, 0] = nan[n - 1, 1] = float("nan")                      # the first NaN wins
    out.append(("NaN columns", x, nan))
    last_nan = w.clone()
    last_nan[n - 1, 2] = float("nan")                             # a NaN only in the last column
    out.append(("a NaN at the end", x, last_nan))
    big = w.clone()
    big[10] = 3e38
    out.append(("inf", x.abs() + 1, big))
    zero = x.clone()
    zero[rows - 1] = 0
    out.append(("a zero row", zero, w))
    out.append(("all equal", x, w[:1].expand(n, k).contiguous()))
    out.append(("all -inf", torch.ones(rows, k).bfloat16(), torch.full((n, k), -3e38).bfloat16()))
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_logits_and_their_argmax_and_health_are_those_of_separate_calls(form, threads, rows):
    n, k = (1008, 64) if form == "panels" else (1056, 64)    # panels: a last item of 3 panels
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for what, x, w in cases(n, k, rows):
            weight = held(w, form)
            want = cpu.linear(x, weight).float()
            out = torch.full((rows, n), 7.0)
            found = cpu.lm_head(x, weight, out)
            assert found is not None, what
            assert torch.equal(out.nan_to_num(1.5), want.nan_to_num(1.5)), what
            ids, codes = reference.greedy_health(want)
            assert torch.equal(found[0], ids), (what, found[0], ids)
            assert torch.equal(found[1], codes), (what, found[1], codes)
    finally:
        torch.set_num_threads(before)


def test_the_broken_rows_are_the_kinds_they_claim_to_be():
    """The cases above reach every health code and the first-NaN and first-maximum rules."""
    n, k = 1008, 64
    got = {}
    for what, x, w in cases(n, k, 5):
        logits = cpu.linear(x, panels.pack(w)).float()
        got[what] = reference.greedy_health(logits)
    assert got["tied maxima"][0][0] == 3
    assert got["NaN columns"][0].tolist() == [7] * 5 and got["NaN columns"][1].tolist() == [1] * 5
    assert got["a NaN at the end"][0].tolist() == [n - 1] * 5
    assert got["inf"][0].tolist() == [10] * 5 and got["inf"][1].tolist() == [1] * 5
    assert got["a zero row"][1][-1] == 2 and got["all equal"][1].tolist() == [3] * 5
    assert got["all -inf"][1].tolist() == [1] * 5 and got["all -inf"][0].tolist() == [0] * 5


@pytest.mark.parametrize("form", FORMS)
def test_what_it_cannot_take_it_leaves_alone(form):
    n, k = 1024, 64
    w = (torch.randn(n, k) * 0.05).bfloat16()
    weight = held(w, form)
    too_many = 17 if form == "amx" else cpu.WIDEN_ROWS
    for x, out in ((torch.randn(too_many, k).bfloat16(), torch.full((too_many, n), 7.0)),   # too many rows
                   (torch.randn(2, k).bfloat16(), torch.full((2, n), 7.0).bfloat16()),       # not float32
                   (torch.randn(2, k).bfloat16(), torch.full((n, 2), 7.0).t()),              # not contiguous
                   (torch.randn(2, 1, k).bfloat16(), torch.full((2, n), 7.0))):              # not [rows, K]
        assert cpu.lm_head(x, weight, out) is None
        assert bool((out == 7).all())
    assert cpu.lm_head(torch.randn(2, k).bfloat16(), w, torch.zeros(2, n)) is None          # a plain weight
    with pytest.raises(RuntimeError, match=r"logits must be a contiguous float32 cpu tensor \[2, 1024\]"):
        cpu.lm_head(torch.randn(2, k).bfloat16(), weight, torch.zeros(2, n - 32))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("lm_head") / "m", vocab_size=512, hidden_size=64,
                           dtype=torch.bfloat16)


def test_an_edit_of_the_logits_is_what_gets_sampled(ckpt):
    """The fused head's argmax is of the logits before a hook's edit: the edited logits decide."""
    def favour(logits):
        logits = logits.clone()
        logits[:, 42] = 1e4
        return logits
    with Session.from_pretrained(ckpt, kernels="cpu", dtype="bfloat16") as sess:
        req = sess.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        with sess.intervene("logits", favour):
            sess.step()
            sess.step()
        assert req.output_token_ids[:2] == [42, 42]


@pytest.mark.parametrize("rows", [0, 1, 16])
def test_pack_greedy_lays_out_what_the_reference_does(rows):
    """The forward's greedy output [2, rows]: the token ids, and the word per row the sampler copies
    to the host (id | code << 32), the same in the cpu set's one call as in the reference's torch
    calls; written into the first rows of a wider buffer (the session's), nothing past them."""
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 151_936, (rows,), generator=gen)
    codes = torch.randint(0, 4, (rows,), generator=gen)
    ours, ref = torch.full((2, rows + 3), -7, dtype=torch.int64), torch.full((2, rows + 3), -7, dtype=torch.int64)
    cpu.pack_greedy(ids, codes, ours[:, :rows])
    reference.pack_greedy(ids, codes, ref[:, :rows])
    assert torch.equal(ours, ref)
    assert ours[0, :rows].tolist() == ids.tolist() and (ours[:, rows:] == -7).all()
    assert [(w & 0xFFFFFFFF, w >> 32) for w in ours[1, :rows].tolist()] == list(zip(ids.tolist(), codes.tolist()))


def test_pack_greedy_keeps_any_code_in_the_upper_half():
    """Codes beyond 2**31 and negative ones, and codes of a narrower dtype (reference), land in the
    upper 32 bits as two's complement bits, the id in the lower, in both sets."""
    ids = torch.tensor([5, 151_935, 0], dtype=torch.int64)
    codes = torch.tensor([2**31 + 5, -1, 3], dtype=torch.int64)
    want = [5 | ((2**31 + 5) << 32) - 2**64, 151_935 | (0xFFFFFFFF << 32) - 2**64, 3 << 32]
    for pack in (cpu.pack_greedy, reference.pack_greedy):
        out = torch.zeros(2, 3, dtype=torch.int64)
        pack(ids, codes, out)
        assert out[1].tolist() == want, pack
    out = torch.zeros(2, 3, dtype=torch.int64)
    reference.pack_greedy(ids, torch.tensor([1, 2, 3], dtype=torch.int32), out)
    assert [w >> 32 for w in out[1].tolist()] == [1, 2, 3]


def test_pack_greedy_refuses_an_output_it_cannot_write():
    ids = codes = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"pack_greedy: out must be an int64 cpu tensor \[2, rows\]"):
        cpu.pack_greedy(ids, codes, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"pack_greedy: out must be an int64 cpu tensor \[2, rows\] with contiguous"):
        cpu.pack_greedy(ids, codes, torch.zeros(4, 2, dtype=torch.int64).t())
    with pytest.raises(RuntimeError, match=r"pack_greedy: ids and codes must be int64 cpu tensors \[3\]"):
        cpu.pack_greedy(ids, codes, torch.zeros(2, 3, dtype=torch.int64))
