"""One huge-page arena that holds a model's weights on the CPU.

Why: a decode step streams every weight from memory once. In ordinary 4 KiB pages, the 1.2 GB
of a 0.6B model in bf16 spans about 300,000 pages, far more than the TLB covers, so the stream
stalls on page walks. Measured on a 2-core AVX2 machine, a plain stream of bf16 weights ran
about 10% faster with two threads and about 60% faster with one from memory backed by
transparent huge pages (2 MiB); the cpu kernel set's decode-shaped matrix-vector products over a
0.6B model's weights, about 5-10% faster. Linux gives huge pages to private anonymous memory that is 2 MiB aligned and
advised with ``madvise(MADV_HUGEPAGE)`` *before* it is first touched (THP mode "madvise" or
"always"); memory that torch allocates and fills itself gets 4 KiB pages.

So the loader plans where every tensor goes, maps one fresh (untouched) region, advises it and
only then copies the weights in; every weight is a view of that one region::

    mapping:  |slack|================ arena: whole 2 MiB pages ================|slack|
                    ^ 2 MiB aligned, advised MADV_HUGEPAGE
    arena:    [embed][q|k|v][o][q_norm][k_norm]...[gate|up][down] ...
               each group starts on a 64-byte boundary; members of a group are packed
               back to back, so q|k|v and gate|up are already the fused matrices

``concat_rows`` turns such adjacent members into one view instead of copying them with
``torch.cat``. The region is unmapped when the last view of it is gone.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20      # bytes of one transparent huge page on x86-64 and arm64
GROUP_ALIGN = 64         # bytes: every group of tensors starts on a cache line
# Below this, weights fit the reach of the TLB in 4 KiB pages (a few thousand entries) and a
# whole huge page would mostly hold nothing: no arena for tiny models.
MIN_ARENA_BYTES = 16 << 20

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Where each tensor lives in the arena: name -> (byte offset, shape), and the bytes needed."""
    offsets: dict[str, tuple[int, tuple[int, ...]]]
    nbytes: int


def plan_layout(groups: list[list[tuple[str, tuple[int, ...]]]], dtype: torch.dtype) -> ArenaLayout:
    """Place ``groups`` of (name, shape) in order: each group on a ``GROUP_ALIGN`` boundary, the
    members of a group back to back (rows of one group are contiguous across its members)."""
    item = torch.empty((), dtype=dtype).element_size()
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    end = 0
    for group in groups:
        end = -(-end // GROUP_ALIGN) * GROUP_ALIGN
        for name, shape in group:
            offsets[name] = (end, tuple(shape))
            end += math.prod(shape) * item
    return ArenaLayout(offsets, end)


class WeightArena:
    """A 2 MiB-aligned region of whole huge pages, advised ``MADV_HUGEPAGE``, and views into it.

    Create one with ``WeightArena.allocate``; it is ``None`` (and the reason is logged at debug
    level) where huge pages would not help or cannot be asked for: fewer than ``MIN_ARENA_BYTES``,
    not Linux, or the kernel refused the mapping or the advice. The region is untouched until the
    first view is written. Its storage is exactly the advised pages (the alignment slack of the
    mapping around it is never touched, so never resident).
    """

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer                      # [nbytes] uint8, the advised region

    @classmethod
    def allocate(cls, nbytes: int) -> "WeightArena | None":
        reason = cls._unavailable(nbytes)
        if reason is None:
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            try:
                region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, ValueError) as e:
                reason = f"mmap of {size + HUGE_PAGE} bytes failed: {e}"
            else:
                probe = ctypes.c_char.from_buffer(region)
                start = -ctypes.addressof(probe) % HUGE_PAGE
                del probe
                try:
                    region.madvise(mmap.MADV_HUGEPAGE, start, size)
                except OSError as e:
                    reason = f"madvise(MADV_HUGEPAGE) failed: {e}"
                else:
                    pages = (ctypes.c_char * size).from_buffer(region, start)   # keeps the mapping alive
                    return cls(torch.frombuffer(pages, dtype=torch.uint8))
        log.debug("weights in ordinary tensors, not a huge-page arena: %s", reason)
        return None

    @staticmethod
    def _unavailable(nbytes: int) -> str | None:
        if nbytes < MIN_ARENA_BYTES:
            return f"{nbytes} bytes of weights fit the TLB's reach in small pages (< {MIN_ARENA_BYTES})"
        if not sys.platform.startswith("linux"):
            return f"huge-page advice is Linux-only (this is {sys.platform})"
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return "this Python's mmap module has no MADV_HUGEPAGE"
        return None

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def views(self, layout: ArenaLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One tensor per name of ``layout``, each a view of the arena (nothing is written)."""
        if layout.nbytes > self.nbytes:
            raise ValueError(f"layout needs {layout.nbytes} bytes; the arena has {self.nbytes}")
        item = torch.empty((), dtype=dtype).element_size()
        out = {}
        for name, (offset, shape) in layout.offsets.items():
            raw = self.buffer[offset:offset + math.prod(shape) * item]
            out[name] = raw.view(dtype).view(shape)
        return out


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0, as a view when the parts already lie back to back.

    The parts (2-d, same dtype, device and column count) are viewed together when each is
    contiguous and starts where the previous one ends in the same storage, as the members of a
    group of an arena do; otherwise they are copied into a new tensor.
    """
    first = parts[0]
    item = first.element_size()
    adjacent = all(p.is_contiguous() and p.dim() == 2 and p.dtype == first.dtype
                   and p.shape[1] == first.shape[1]
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for p in parts)
    if adjacent:
        expect = first.data_ptr()
        for p in parts:
            adjacent = adjacent and p.data_ptr() == expect
            expect += p.numel() * item
    if not adjacent:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))   # [sum rows, cols]
