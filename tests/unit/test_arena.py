"""The huge-page weight arena: one storage, the checkpoint's exact values, fused views, advice."""
from __future__ import annotations

import logging
import mmap
import sys
from pathlib import Path

import pytest
import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import get_kernels
from qwen_npu.model import arena as arena_mod
from qwen_npu.model.arena import GROUP_ALIGN, HUGE_PAGE, WeightArena, concat_rows, plan_layout
from qwen_npu.model.loader import arena_groups, load_checkpoint
from qwen_npu.model.qwen3 import Qwen3Model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture
def small_arenas(monkeypatch):
    """Arenas for the tiny test checkpoints too (normally only from MIN_ARENA_BYTES of weights)."""
    monkeypatch.setattr(arena_mod, "MIN_ARENA_BYTES", 0)


def thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages ("always", "madvise", "never"), or None."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def storage_ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address`` (plus "range")."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:                # a mapping's header line
            if inside:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
            if inside:
                fields["range"] = head
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_views_of_one_storage_with_the_checkpoints_values(tiny_ckpt_small_vocab, dtype,
                                                                      small_arenas):
    _, plain = load_checkpoint(tiny_ckpt_small_vocab, dtype=dtype, arena=False)
    _, packed = load_checkpoint(tiny_ckpt_small_vocab, dtype=dtype)
    assert packed.keys() == plain.keys()
    for name, want in plain.items():
        got = packed[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dim() else got,
                           want.contiguous().view(torch.uint8) if want.dim() else want), name
    assert len(storage_ptrs(packed.values())) == 1
    assert packed["lm_head.weight"] is packed["model.embed_tokens.weight"]     # tied: one tensor
    if sys.platform.startswith("linux"):
        assert packed["model.embed_tokens.weight"].untyped_storage().data_ptr() % HUGE_PAGE == 0


def test_the_models_fused_matrices_are_views_into_the_arena(tiny_ckpt_small_vocab, small_arenas):
    cfg, weights = load_checkpoint(tiny_ckpt_small_vocab)
    model = Qwen3Model(cfg, weights, get_kernels("reference"))
    fused = [t for layer in model.layers for t in (layer.qkv, layer.gate_up)]
    assert storage_ptrs(fused) == storage_ptrs([model.embed])
    p = "model.layers.1."
    want_qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    want_gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[1].qkv, want_qkv) and torch.equal(model.layers[1].gate_up, want_gate_up)
    assert model.layers[1].qkv.data_ptr() == weights[p + "self_attn.q_proj.weight"].data_ptr()


def test_arena_groups_pack_only_one_layers_fused_projections():
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{n}" for i in range(2) for n in
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    groups = arena_groups(names)
    assert [len(g) for g in groups] == [1, 3, 1, 2, 1, 3, 1, 2, 1]
    assert groups[5][0] == "model.layers.1.self_attn.q_proj.weight"
    # a k without its q (e.g. q stored in another shard) starts a group of its own
    assert [len(g) for g in arena_groups(names[2:4])] == [2]


def test_plan_layout_aligns_groups_and_packs_their_members():
    layout = plan_layout([[("a", (3,))], [("q", (2, 5)), ("k", (1, 5))], [("b", (7,))]], torch.bfloat16)
    assert layout.offsets == {"a": (0, (3,)), "q": (GROUP_ALIGN, (2, 5)), "k": (GROUP_ALIGN + 20, (1, 5)),
                              "b": (2 * GROUP_ALIGN, (7,))}
    assert layout.nbytes == 2 * GROUP_ALIGN + 14


def test_concat_rows_views_adjacent_parts_and_copies_others():
    base = torch.arange(24.0)
    q, k = base[:12].view(4, 3), base[12:18].view(2, 3)
    joined = concat_rows([q, k])
    assert joined.data_ptr() == q.data_ptr() and torch.equal(joined, torch.cat([q, k]))
    gap = base[19:22].view(1, 3)                            # one element after k: not adjacent
    for parts in ([q, gap], [k, q], [q, k.clone()]):
        out = concat_rows(parts)
        assert torch.equal(out, torch.cat(parts))
        assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux-only")
@pytest.mark.skipif(thp_mode() in (None, "never"),
                    reason=f"transparent huge pages are off here ({THP}: {thp_mode()})")
def test_the_arena_is_advised_and_backed_by_huge_pages(small_arenas):
    arena = WeightArena.allocate(3 * HUGE_PAGE - 100)
    assert arena is not None and arena.address % HUGE_PAGE == 0 and arena.nbytes == 3 * HUGE_PAGE
    assert arena.buffer.untyped_storage().nbytes() == 3 * HUGE_PAGE      # the slack is not part of it
    before = mapping_of(arena.address)
    assert "hg" in before["VmFlags"].split(), f"mapping {before['range']} not advised: {before['VmFlags']}"
    assert before.get("THPeligible", "1") == "1"
    arena.buffer.fill_(7)
    after = mapping_of(arena.address)
    huge_kb = int(after["AnonHugePages"].split()[0])
    assert huge_kb > 0, (f"the kernel gave the advised arena no huge page (AnonHugePages {huge_kb} kB "
                         f"in {after['range']}); memory may be too fragmented to compact")


def test_without_huge_page_advice_the_loader_falls_back_to_ordinary_tensors(tiny_ckpt_small_vocab, small_arenas,
                                                                           monkeypatch, caplog):
    _, plain = load_checkpoint(tiny_ckpt_small_vocab, arena=False)
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", -1, raising=False)      # the kernel refuses the advice
    with caplog.at_level(logging.DEBUG, logger=arena_mod.__name__):
        cfg, weights = load_checkpoint(tiny_ckpt_small_vocab)
    if sys.platform.startswith("linux"):
        assert "madvise(MADV_HUGEPAGE) failed" in caplog.text
    assert len(storage_ptrs(weights.values())) == len(plain) - 1       # separate tensors (lm_head tied)
    assert all(torch.equal(weights[n], plain[n]) for n in plain)
    model = Qwen3Model(cfg, weights, get_kernels("reference"))
    assert model.layers[0].qkv.shape[0] == cfg.q_size + 2 * cfg.kv_size


def test_off_linux_there_is_no_arena(monkeypatch, small_arenas):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert WeightArena.allocate(HUGE_PAGE) is None


def test_tiny_weights_get_no_arena(tiny_ckpt_small_vocab, caplog):
    with caplog.at_level(logging.DEBUG, logger=arena_mod.__name__):
        _, weights = load_checkpoint(tiny_ckpt_small_vocab)
    assert "fit the TLB's reach" in caplog.text
    assert len(storage_ptrs(weights.values())) > 1
    assert WeightArena.allocate(arena_mod.MIN_ARENA_BYTES - 1) is None


def test_a_session_on_an_arena_computes_exactly_what_it_did_without(tiny_ckpt_small_vocab, monkeypatch):
    """Same checkpoint, reference kernels: bit-identical logits of every step with and without."""
    def logits_of_a_run():
        sess = Session.from_pretrained(tiny_ckpt_small_vocab, kernels="reference", max_batch=2, chunk_size=8,
                                       max_model_len=64)
        reqs = [sess.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=5, ignore_eos=True)),
                sess.add_request([7, 8, 9], SamplingParams(max_new_tokens=5, ignore_eos=True))]
        rows = []
        while not all(r.is_done for r in reqs):
            step = sess.step()
            if step.logits is not None:
                rows.append(step.logits.tensor.clone())
        return sess, torch.cat(rows)
    plain_sess, plain = logits_of_a_run()
    assert len(storage_ptrs([plain_sess.model.embed, plain_sess.model.layers[0].qkv])) == 2
    monkeypatch.setattr(arena_mod, "MIN_ARENA_BYTES", 0)
    packed_sess, packed = logits_of_a_run()
    assert len(storage_ptrs([packed_sess.model.embed, packed_sess.model.layers[0].qkv])) == 1
    assert torch.equal(packed, plain)
