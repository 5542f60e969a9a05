"""Per-row logits health codes: the CPU shortcut (max/min only) agrees with the explicit checks."""
import torch

from qwen_npu.engine.sampler import health_codes as _health_codes


def explicit_codes(logits: torch.Tensor) -> list[int]:
    codes = []
    for row in logits:
        if not torch.isfinite(row).all():
            codes.append(1)
        elif row.eq(0).all():
            codes.append(2)
        elif row.eq(row[0]).all():
            codes.append(3)
        else:
            codes.append(0)
    return codes


def test_every_kind_of_row_gets_its_code():
    logits = torch.randn(10, 37, generator=torch.Generator().manual_seed(0))
    logits[1, 5] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 36] = float("-inf")
    logits[4] = 0.0
    logits[5] = 2.5
    logits[6, 3], logits[6, 4] = float("nan"), float("-inf")
    logits[7] = float("nan")
    logits[8] = float("-inf")
    logits[9, :] = 0.0
    logits[9, 20] = 1e-30                      # almost all zero: healthy
    codes = _health_codes(logits)
    assert codes.dtype == torch.int64
    assert codes.tolist() == explicit_codes(logits) == [0, 1, 1, 1, 2, 3, 1, 1, 1, 0]
