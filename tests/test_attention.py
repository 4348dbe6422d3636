"""torch's fused attention as the package calls it (`models.attention.fused_attention`): a query block the CPU's
bf16 kernel would leave one row in a tile of its own gets a padding row, and the result is the plain call's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cacheblend_rag.models.attention import fused_attention, lone_query_row


@pytest.mark.parametrize(
    ("rows", "lone"), [(1, True), (2, False), (32, False), (33, True), (65, True), (66, False), (161, True),
                       (193, True), (225, False), (257, True), (769, True), (1025, True), (800, False)],
)  # fmt: skip
def test_which_query_blocks_leave_the_bf16_kernel_one_row(rows, lone):
    assert lone_query_row(torch.empty(2, rows, 8, dtype=torch.bfloat16)) is lone
    assert lone_query_row(torch.empty(2, rows, 8, dtype=torch.float32)) is False  # fp32 has no slow path


@pytest.mark.parametrize("rows", [1, 7, 33, 65, 193])
@pytest.mark.parametrize("mask_kind", ["per_row", "broadcast", "none"])
def test_a_padded_block_gives_the_plain_calls_result(rows, mask_kind):
    generator = torch.Generator().manual_seed(rows)
    q = torch.randn(1, 6, rows, 16, generator=generator).bfloat16()
    k, v = (torch.randn(1, 2, 300, 16, generator=generator).bfloat16() for _ in range(2))
    mask = {
        "per_row": torch.rand(1, 1, rows, 300, generator=generator) > 0.3,
        "broadcast": torch.rand(1, 1, 1, 300, generator=generator) > 0.3,
        "none": None,
    }[mask_kind]
    ours = fused_attention(q, k, v, mask, 0.25, enable_gqa=True)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert ours.shape == plain.shape
    assert torch.equal(ours[..., :-1, :], plain[..., :-1, :])  # the rows beside the padding are untouched
    torch.testing.assert_close(ours, plain, atol=1e-4, rtol=1e-2)  # the last row: another path, the same sum


def test_causal_calls_are_not_padded():
    q, k, v = (torch.randn(1, 2, 33, 16).bfloat16() for _ in range(3))
    ours = fused_attention(q, k, v, None, 0.25, is_causal=True)
    assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25))
