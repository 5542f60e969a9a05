"""AttentionMetadata.for_rows: the metadata of a step built by hand from its rows."""
import torch

from qwen_npu.kernels import AttentionMetadata


def test_for_rows_gives_the_documented_example():
    tables = torch.tensor([[7, -1], [2, 5]], dtype=torch.int32)
    meta = AttentionMetadata.for_rows([(0, 4), (16, 2)], [112, 113, 114, 115, 80, 81], tables)
    assert meta.positions.tolist() == [0, 1, 2, 3, 16, 17]
    assert meta.query_start_loc.tolist() == [0, 4, 6] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [4, 18] and meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [112, 113, 114, 115, 80, 81]
    assert torch.equal(meta.block_tables, tables)
    assert (meta.query_lens_host, meta.seq_lens_host) == ((4, 2), (4, 18))
    assert not meta.is_decode and (meta.num_rows, meta.num_tokens, meta.max_seq_len) == (2, 6, 18)
    decode = AttentionMetadata.for_rows([(3, 1), (9, 1)], [3, 41], tables)
    assert decode.is_decode and decode.positions.tolist() == [3, 9]
