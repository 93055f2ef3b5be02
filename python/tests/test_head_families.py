"""The filtered backward's accuracy over heads built in different ways (issue 44, docs/filtered_backward.md).

grpo.head_families builds LM heads as published measurements describe trained
output embeddings (a shared mean direction, a power-law spectrum, frequency-
ordered norms, a rare-token cluster, and an isotropic control), each from its
own construction, with trained-like logits (entropies of mean 0.5-1 nat). On
every one, grad_filter="auto" must keep dhidden and dW within 1.2x of the exact
step's relative L2 error against a float64 reference with the logits
materialized (f32 gradients: the exact step's error is its bf16 dlogits'). The
filter before its guard failed this on 7 of the 9 heads (another seed, AMD EPYC
Zen 5: dhidden up to 4.6x, dW up to 2.4x the exact step's);
test_the_rule_alone_fails_there shows the unguarded rule failing on these.
"""

import pytest
import torch

import grpo
from grpo import head_families as hf

SHAPE = (128, 256, 16384)  # T, H, V: V past the 64 x 256-column kept groups, seconds per head


def _measure(i, token_block=None, shape=SHAPE):
    family, params = hf.MATRIX[i]
    t, h, v = shape
    head = hf.prepare_loss_inputs(hf.make_head(family, params, t, h, v, seed=40 + i), seed=40 + i)
    return hf.measure(head, threads=2, token_block=token_block)


@pytest.mark.parametrize("i", range(len(hf.MATRIX)), ids=[f"{f}-{i}" for i, (f, _) in enumerate(hf.MATRIX)])
def test_filtered_error_within_the_exact_steps(i):
    row = _measure(i)
    # The reference computes the loss the library does (a wrong reference would make the ratios meaningless).
    assert row["loss_rel"] < 1e-4 and row["logp_max_abs"] < 1e-3, row
    assert row["loss_bitwise"], row
    assert 0.0 < row["dhidden_exact"] < 2e-2 and 0.0 < row["dweight_exact"] < 2e-2, row
    assert row["dhidden_filtered"] <= 1.2 * row["dhidden_exact"], row
    assert row["dweight_filtered"] <= 1.2 * row["dweight_exact"], row


def test_the_guard_still_lets_the_filter_pay():
    """Not a filter that is off: on most of the heads the guard lets every block run filtered (at eps or a
    lower rung) and the filter leaves out most of the backward (measured: 6 of 9 here, 50-97% left out)."""
    paying = []
    for i in range(len(hf.MATRIX)):
        row = _measure(i)
        if row["guard_blocks"] == 0 and row["skipped_frac"] > 0.4:
            paying.append(row["head"])
    assert len(paying) >= 5, paying


@pytest.mark.parametrize("i", [1, 3, 8])
def test_guard_per_block_and_dweight_over_the_blocks(i):
    """Several token blocks (64 rows): dhidden's guard per block, dW's over the blocks so far."""
    row = _measure(i, token_block=64, shape=(256, 256, 16384))
    assert row["dhidden_filtered"] <= 1.2 * row["dhidden_exact"], row
    assert row["dweight_filtered"] <= 1.2 * row["dweight_exact"], row


def test_the_rule_alone_fails_there():
    """What the guard is for: the same rule and correction without it (an explicit 2^-12, which the guard
    leaves as the caller's choice) exceed 1.2x the exact step's error on some of these heads."""
    worst = 0.0
    for i, (family, params) in enumerate(hf.MATRIX):
        t, h, v = SHAPE
        head = hf.prepare_loss_inputs(hf.make_head(family, params, t, h, v, seed=40 + i), seed=40 + i)
        row = hf.measure(head, threads=2, grad_filter=2.0**-12)
        assert row["guard_blocks"] == 0
        worst = max(worst, row["dhidden_filtered"] / row["dhidden_exact"], row["dweight_filtered"] / row["dweight_exact"])
    assert worst > 1.2
