"""python -m grpo.precision (issue 19, item 3) at a small shape: its float64 reference is right, and grpo's bf16
gradients are closer to it than torch eager's."""

import pytest

pytest.importorskip("trl")

from grpo import precision  # noqa: E402


def test_reference_agrees_with_both_f32_paths():
    """In float32 every path is within a few float32 ulps (x sqrt(depth)) of the float64 reference: if the
    reference's LSE, coefficients or sums were wrong, both would be far off."""
    r = precision.measure(1, 256, 64, 1024, "f32", "offpolicy", 16, 16, "f64")
    for grad in ("dhidden", "dweight"):
        for path in ("grpo", "eager"):
            assert r["errors"][grad][path]["rel_l2"] < 1e-5, (grad, path, r["errors"][grad][path])


def test_grpo_bf16_gradients_beat_eager_and_stay_near_the_rounding_floor():
    """bf16, 8 token blocks (8 roundings of the accumulated dW): grpo's error stays within a few times the
    floor of one rounding (2^-9 relative per entry), while eager's bf16 logits (|z| ~ 3: 2^-9 * 3 absolute
    in every logit) put its error far above it."""
    r = precision.measure(1, 2048, 128, 4096, "bf16", "offpolicy", 32, 32, "f32", token_block=256)
    for grad in ("dhidden", "dweight"):
        e = r["errors"][grad]
        assert e["grpo"]["rel_l2"] < e["eager"]["rel_l2"], (grad, e)
        assert e["grpo"]["rel_l2"] < 4 * e["ref_rounded"]["rel_l2"], (grad, e)


def test_grpo_f16_gradients_sit_at_the_f16_rounding_floor():
    """fp16 (f32 dlogits, each gradient rounded once to fp16 per token block; 8 blocks): grpo's error stays
    within a few times one fp16 rounding of the float64 reference (2^-11 relative per entry), far below
    bf16's floor. torch eager is left out (its CPU float16 GEMMs are slow)."""
    r = precision.measure(1, 2048, 128, 4096, "f16", "offpolicy", 32, 32, "f32", token_block=256, eager=False)
    for grad in ("dhidden", "dweight"):
        e = r["errors"][grad]
        assert e["eager"] is None
        assert e["grpo"]["rel_l2"] < 4 * e["ref_rounded"]["rel_l2"], (grad, e)
        assert e["grpo"]["rel_l2"] < 2.0**-9, (grad, e)
