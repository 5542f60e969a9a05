import pytest

from qwen_npu.cache.block_table import blocks_needed, pad_block_tables, slot_mapping


def test_docstring_example():
    assert slot_mapping([7, 2, 9], 3, 7, 4) == [31, 8, 9, 10]
    assert slot_mapping([7, 2, 9], 9, 10, 4) == [37]
    assert slot_mapping([7, 2, 9], 0, 12, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]


def test_single_token_fast_path_matches_formula():
    table, size = [3, 0, 5], 2
    for pos in range(6):
        assert slot_mapping(table, pos, pos + 1, size) == [table[pos // size] * size + pos % size]


def test_matches_formula_for_every_range():
    table, size = [4, 1, 6, 0], 3
    for start in range(13):
        for end in range(start, 13):
            expected = [table[p // size] * size + p % size for p in range(start, end)]
            assert slot_mapping(table, start, end, size) == expected


def test_block_size_one():
    assert slot_mapping([5, 3, 8], 0, 3, 1) == [5, 3, 8]


def test_empty_range():
    assert slot_mapping([], 0, 0, 4) == []
    assert slot_mapping([1], 4, 4, 4) == []


@pytest.mark.parametrize("start,end", [(8, 9), (6, 9), (8, 10), (12, 13)])
def test_position_without_block_raises(start, end):
    with pytest.raises(ValueError, match="has no block"):
        slot_mapping([7, 2], start, end, 4)


def test_padding_entry_is_no_block():
    with pytest.raises(ValueError, match="holds -1"):
        slot_mapping([7, -1], 5, 6, 4)
    with pytest.raises(ValueError, match="holds -1"):
        slot_mapping([7, -1], 2, 6, 4)
    with pytest.raises(ValueError, match="holds -1"):
        slot_mapping([-1], 0, 1, 4)


def test_bad_arguments():
    with pytest.raises(ValueError):
        slot_mapping([1, 2], 3, 2, 4)
    with pytest.raises(ValueError):
        slot_mapping([1, 2], -1, 2, 4)
    with pytest.raises(ValueError):
        slot_mapping([1, 2], 0, 1, 0)
    with pytest.raises(ValueError):
        slot_mapping([1, 2], 0, 3, 0)


def test_accepts_any_sequence():
    assert slot_mapping((7, 2), 4, 6, 4) == [8, 9]
    assert slot_mapping(range(3), 5, 6, 4) == [5]


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert blocks_needed(7, 1) == 7
    with pytest.raises(ValueError):
        blocks_needed(-1, 4)
    with pytest.raises(ValueError):
        blocks_needed(3, 0)


def test_pad_block_tables():
    tables = [[7, 2], [5], []]
    padded = pad_block_tables(tables, 3)
    assert padded == [[7, 2, -1], [5, -1, -1], [-1, -1, -1]]
    padded[0][0] = 99
    assert tables[0] == [7, 2]  # copies, not views
    assert pad_block_tables([], 4) == []
    assert pad_block_tables([(1, 2)], 2) == [[1, 2]]
    with pytest.raises(ValueError, match="row 1"):
        pad_block_tables([[1], [1, 2, 3]], 2)
