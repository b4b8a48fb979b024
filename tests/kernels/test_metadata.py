"""``build_metadata``: the one place a step's slots, starts and padded tables come from."""

from __future__ import annotations

import gc

import pytest
import torch

from pagefleet.kernels.metadata import build_metadata, index_tensor


def test_slots_starts_and_padded_tables_follow_each_sequences_blocks():
    bs = 4
    # Two decodes (one on a block boundary), a chunk continuing a cached prefix mid-block,
    # and a fresh prompt over scattered blocks.
    tables = [[7, 3], [9], [5, 1, 8], [2, 6]]
    query_lens = [1, 1, 3, 6]
    seq_lens = [5, 4, 10, 6]
    meta = build_metadata(tables, query_lens, seq_lens, bs, pad_slots=2)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [
        3 * bs + 0,  # position 4: block 1 of [7, 3]
        9 * bs + 3,  # position 3: last slot of block 9
        1 * bs + 3,  # positions 7, 8, 9 of [5, 1, 8]
        8 * bs + 0,
        8 * bs + 1,
        2 * bs + 0,  # positions 0..5 of [2, 6]
        2 * bs + 1,
        2 * bs + 2,
        2 * bs + 3,
        6 * bs + 0,
        6 * bs + 1,
        -1,
        -1,
    ]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5, 11]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()
    assert meta.block_tables.tolist() == [[7, 3, 0], [9, 0, 0], [5, 1, 8], [2, 6, 0]]
    assert meta.seq_lens.tolist() == seq_lens
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (2, 6, 10)
    assert meta.num_seqs == 4


def test_num_decodes_counts_only_the_leading_single_token_sequences():
    meta = build_metadata([[1], [2], [3]], [1, 4, 1], [3, 4, 2], 4)
    assert meta.num_decodes == 1


@pytest.mark.parametrize(
    ("tables", "query_lens", "seq_lens"),
    [([[1]], [5], [5]), ([[1, 2]], [0], [3]), ([[1, 2]], [4], [3])],
)
def test_a_table_short_of_its_context_or_a_bad_query_length_is_refused(
    tables, query_lens, seq_lens
):
    with pytest.raises(ValueError, match="need 1 <= new <= tokens"):
        build_metadata(tables, query_lens, seq_lens, 4)


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_index_tensor_equals_torch_tensor_and_owns_its_values(int_dtype):
    values = [7, 0, -1, 2**31 - 1, 3]
    t = index_tensor(iter(values), int_dtype)  # any iterable; the buffer lives with the tensor
    gc.collect()
    assert t.dtype == int_dtype and torch.equal(t, torch.tensor(values, dtype=int_dtype))
    assert t.is_contiguous() and t.shape == (5,)
    empty = index_tensor([], int_dtype)
    assert empty.dtype == int_dtype and empty.shape == (0,)
