"""Block tables -> the compressed page lists FlashInfer's wrappers are planned with."""

import numpy as np
import pytest

from tokenspeed_aio.model.attention.page_table import paged_kv


def test_rows_become_page_lists_with_their_last_page_fill():
    tables = np.array([[7, 3, 0, 0], [5, 0, 0, 0], [2, 9, 4, 8]], np.int32)
    table = paged_kv(np.array([17, 1, 64]), tables, page_size=16)
    assert table.indptr.tolist() == [0, 2, 3, 7]
    assert table.indices.tolist() == [7, 3, 5, 2, 9, 4, 8]
    assert table.last_page_len.tolist() == [1, 1, 16]
    assert {a.dtype for a in table} == {np.dtype(np.int32)}


def test_graph_padding_rows_read_one_token_of_the_null_block():
    tables = np.zeros((3, 2), np.int32)
    tables[0] = [4, 6]
    table = paged_kv(np.array([20, 1, 1]), tables, page_size=16)
    assert table.indices.tolist() == [4, 6, 0, 0]
    assert table.last_page_len.tolist() == [4, 1, 1]


@pytest.mark.parametrize("seq_lens", [[0], [33]])
def test_a_row_without_tokens_or_without_enough_table_is_refused(seq_lens):
    with pytest.raises(ValueError, match="pages"):
        paged_kv(np.array(seq_lens), np.zeros((1, 2), np.int32), page_size=16)
