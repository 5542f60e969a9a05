"""The cpu set's write_kv from views of the fused qkv output (read in place, the tokens a stride
apart), across threads for a prefill chunk: the cache ends as the naive write leaves it."""
from __future__ import annotations

import pytest
import torch

from qwen_npu.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"cpu kernels: {cpu.availability()[1]}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 300])
def test_views_of_the_fused_output_land_as_their_copies(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d, num_blocks, block_size = 4, 2, 32, 40, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    assert tokens == 1 or not v.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1                                                   # skipped tokens
    start = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    kc, vc = start.clone(), start.clone()
    cpu.write_kv(k, v, kc, vc, slots)
    want_k, want_v = start.clone().view(-1, kv_heads, d), start.clone().view(-1, kv_heads, d)
    keep = slots >= 0
    want_k[slots[keep]] = k[keep].contiguous()
    want_v[slots[keep]] = v[keep].contiguous()
    assert torch.equal(kc.view(-1, kv_heads, d), want_k) and torch.equal(vc.view(-1, kv_heads, d), want_v)


def test_a_view_whose_heads_are_not_adjacent_is_copied_first():
    """Heads a stride apart within a token: the row is not contiguous, so it is gathered first."""
    k = torch.randn(5, 3, 16).bfloat16()
    v = torch.randn(5, 3, 32).bfloat16()[:, :, :16]                  # heads 32 apart, 16 values each
    kc, vc = torch.zeros(4, 4, 3, 16).bfloat16(), torch.zeros(4, 4, 3, 16).bfloat16()
    slots = torch.tensor([3, 0, 9, -1, 15])
    cpu.write_kv(k, v, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc.view(-1, 3, 16)[s], k[t]) and torch.equal(vc.view(-1, 3, 16)[s], v[t])
    assert not vc.view(-1, 3, 16)[[1, 2, 4]].any()                    # slots no token names stay as they were


@pytest.mark.parametrize("k_shape, v_shape, slots", [((3, 2, 8), (3, 2, 8), 4), ((3, 2, 8), (3, 2, 4), 3),
                                                     ((3, 2, 4), (3, 2, 4), 3)],
                         ids=["fewer-tokens-than-slots", "value-unlike-key", "row-unlike-the-cache"])
def test_shapes_that_disagree_are_refused_before_anything_is_written(k_shape, v_shape, slots):
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="cpu write_kv"):
        cpu.ops().write_kv(torch.ones(k_shape), torch.ones(v_shape), kc, vc, torch.arange(slots))
    assert not kc.any() and not vc.any()
