"""kernels.pages: anonymous memory (zeroed, huge pages asked for) and matrices copied in a row order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hotcold.gguf.quants import QuantTensor
from hotcold.kernels import pages
from tests.fixtures import random_blocks


@pytest.mark.parametrize("huge", [False, True])
def test_anonymous_is_zeroed_and_writable(huge):
    for shape in ((3, 5), (1024, 1024)):  # under and over the map's threshold
        t = pages.anonymous(shape, torch.float16, huge=huge)
        assert t.shape == shape and t.dtype == torch.float16 and not t.any()
        t[-1, -1] = 2.0
        assert float(t.sum()) == 2.0


def test_rows_in_order_of_a_float_matrix():
    w = torch.randn(700, 1024).half()  # 1.4 MB: an anonymous map
    order = torch.randperm(700)
    got = pages.rows_in_order(w, order)
    assert torch.equal(got, w[order]) and got.data_ptr() != w.data_ptr()


def test_rows_in_order_of_quantized_rows_with_a_wider_stride():
    rng = np.random.default_rng(0)
    rows, blocks = 40, 4  # 4 Q8_0 blocks (128 values) a row, stored 8 bytes apart more than a row
    raw = random_blocks(Q.Q8_0, rows * blocks, rng).reshape(rows, -1)
    padded = torch.zeros(rows, raw.shape[1] + 8, dtype=torch.uint8)
    padded[:, : raw.shape[1]] = torch.from_numpy(raw)
    q = QuantTensor(padded[:, : raw.shape[1]], Q.Q8_0, (rows, 128))
    order = torch.randperm(rows)
    got = pages.rows_in_order(q, order)
    assert isinstance(got, QuantTensor) and got.qtype == Q.Q8_0 and got.shape == (rows, 128)
    assert torch.equal(got.data, torch.from_numpy(raw)[order])


def test_rows_in_order_refuses_an_order_of_another_length():
    with pytest.raises(ValueError, match="rows_in_order"):
        pages.rows_in_order(torch.zeros(4, 4), torch.arange(3))
