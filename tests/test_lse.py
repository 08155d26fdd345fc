"""Partial attention and the log-sum-exp merge against plain softmax attention."""

import pytest
import torch

from tierkv.attention.lse import FullyMaskedRows, merge, merge_all, partial_attention


@pytest.mark.parametrize("masked", [False, True])
def test_fused_and_reference_chunk_attention_agree(monkeypatch, masked):
    """The fused CPU kernel path and the plain einsum path give the same (output, log-sum-exp) state."""
    from tierkv.attention import lse

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 5, 16, generator=gen)  # [B, H_kv, G, q, D]
    keys, values = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    mask = torch.rand(2, 1, 5, 9, generator=gen) > 0.3 if masked else None
    bias = lse.mask_bias(mask, 0, 9, 9, 5, torch.float32, q.device)
    fused = lse.partial_attention(q, keys, values, bias, 0.25, None)
    monkeypatch.setattr(lse, "_FUSED_CPU", None)
    plain = lse.partial_attention(q, keys, values, bias, 0.25, None)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_weighted_attention_returns_the_output_and_each_keys_softmax_weight(softcap):
    """The one-pass path sparse attention uses for per-block shares: the same output as partial_attention,
    and weights that are the masked, soft-capped softmax of the scores."""
    from tierkv.attention import lse

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 3, 1, 16, generator=gen) * 3  # [B, H_kv, G, q, D]
    keys, values = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    bias = lse.mask_bias(torch.rand(2, 1, 1, 9, generator=gen) > 0.3, 0, 9, 9, 1, torch.float32, q.device)
    out, weights, total = lse.weighted_attention(q, keys, values, bias, 0.25, softcap)
    reference, reference_lse = lse.partial_attention(q, keys, values, bias, 0.25, softcap)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total, reference_lse, atol=1e-5, rtol=1e-5)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, keys) * 0.25
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    expected = (scores + bias.unsqueeze(2)).softmax(-1)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
    assert (weights.masked_select(bias.unsqueeze(2).expand_as(weights) < 0) == 0).all()  # masked keys: no weight



@pytest.mark.parametrize("cuts", [((0, 7), (7, 8), (8, 20)), ((0, 20),), ((0, 1), (1, 2), (2, 3), (3, 19), (19, 20))])
def test_merging_chunks_equals_attention_over_all_keys(cuts):
    """Merged in turn (``merge``) or all at once (``merge_all``), the pieces give softmax attention over every key."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 2, 3, 8, generator=gen) * 4  # [B, H_kv, G, q, D]; scaled up: pieces of unequal mass
    keys, values = torch.randn(1, 2, 20, 8, generator=gen), torch.randn(1, 2, 20, 8, generator=gen)
    pieces = [partial_attention(q, keys[:, :, lo:hi], values[:, :, lo:hi], None, 0.3, None) for lo, hi in cuts]
    out = lse = None
    for piece in pieces:
        out, lse = merge(out, lse, *piece)
    assert out is not None and lse is not None
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, keys) * 0.3
    expected = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1), values)
    for merged_out, merged_lse in ((out, lse), merge_all(pieces)):
        torch.testing.assert_close(merged_out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged_lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strided", ["query", "keys", "values"])
def test_inputs_strided_in_their_last_dimension_attend_as_contiguous_ones(strided):
    """Regression: the fused CPU kernel reads each row's last dimension as contiguous; a query strided there (what
    gpt-oss's rotary makes at head dim 2) was attended over other memory: prefill logits off by up to 1e28 or NaN
    through streaming, split and sparse, and different from run to run."""
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):  # stored with the last dimension outermost: stride(-1) > 1
        return torch.randn(shape[-1], *shape[:-1], generator=generator).movedim(0, -1)

    q = tensor(1, 3, 2, 6, 2) if strided == "query" else torch.randn(1, 3, 2, 6, 2, generator=generator)
    k = tensor(1, 3, 6, 2) if strided == "keys" else torch.randn(1, 3, 6, 2, generator=generator)
    v = tensor(1, 3, 6, 2) if strided == "values" else torch.randn(1, 3, 6, 2, generator=generator)
    assert {"query": q, "keys": k, "values": v}[strided].stride(-1) > 1
    out, lse = partial_attention(q, k, v, None, 0.7, None)
    want, want_lse = partial_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, 0.7, None)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


def test_fully_masked_rows_are_found_once_a_forward():
    rows = FullyMaskedRows()
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    assert rows(mask) is None
    mask[1, 0, 2] = False
    assert rows(mask) is None  # the same forward: the same answer
    rows.forget()  # the next forward: found again
    found = rows(mask)
    assert found.uniform is None and found.empty.nonzero().tolist() == [[1, 0, 2]]
    additive = torch.zeros(1, 1, 3, 4).index_fill_(2, torch.tensor([0]), torch.finfo(torch.float32).min)
    additive[0, 0, 2] = float("-inf")  # hidden outright: sdpa's zeros, not the mean
    found = rows(additive)
    assert found.uniform.tolist() == [[[True, False, False]]] and found.empty.tolist() == [[[False, False, True]]]
    with torch.inference_mode():
        assert rows(torch.zeros(1, 1, 2, 4, dtype=torch.bool)).empty.all()
    assert rows(torch.zeros(1, 1, 1, 4, dtype=torch.int64)) is None  # not a mask transformers makes: left alone
