"""hf_csv_kernels.floats: the floating-point facts the bounds rest on, and the one refusal of a non-finite weight that
both quantizers (the torch path and the C one) raise."""
import math

import pytest
import torch

from hf_csv_kernels import floats, native, quantize


def test_unit_roundoff_and_gamma_are_the_textbook_values():
    assert floats.unit_roundoff() == 2.0 ** -24
    assert floats.unit_roundoff(torch.float64) == 2.0 ** -53
    u = 2.0 ** -24
    assert floats.gamma(10) == 10 * u / (1 - 10 * u)
    with pytest.raises(ValueError, match="undefined"):
        floats.gamma(2 ** 24)


def test_round_up_f32_gives_the_smallest_float32_not_below_the_value():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (4000,),
                                                                                              generator=g),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0 ** -149, 1e-50, -1e-50], dtype=torch.float64)])
    y = floats.round_up_f32(x)
    assert y.dtype == torch.float32
    assert (y.double() >= x).all()
    below = torch.nextafter(y, torch.full_like(y, -math.inf))
    assert (below.double() < x).all()  # the next float32 down is below the value: y is the least upper float32
    exact = torch.tensor([1.5, -3.25, 0.0], dtype=torch.float64)
    assert torch.equal(floats.round_up_f32(exact), exact.float())  # representable values stay


def test_both_quantizers_refuse_a_non_finite_weight_with_the_same_error():
    assert quantize.NonFiniteWeightError is floats.NonFiniteWeightError  # the quantizer's callers catch it there
    assert issubclass(floats.NonFiniteWeightError, ValueError)
    W = torch.randn(64, 32)
    W[5, 7] = float("nan")
    with pytest.raises(floats.NonFiniteWeightError):
        quantize.quantize_rows_fp8(W, progress=False)
    if native.available():
        with pytest.raises(floats.NonFiniteWeightError):
            native.quantize_i8(W.contiguous())
