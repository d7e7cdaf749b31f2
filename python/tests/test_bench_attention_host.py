"""tilewire.bench_attention's host pieces: the FLOP counts (the backward's 2.5 times the
forward's, causal halved), the gradients' relative error, the side-by-side row and the --pass
option, on the CPU."""

import pytest

torch = pytest.importorskip("torch")

from tilewire import bench_attention  # noqa: E402


def test_backward_flops_are_two_and_a_half_forwards():
    b, h, s, d = 4, 16, 4096, 128
    forward = 4.0 * b * h * s * s * d
    assert bench_attention.flops(b, h, s, d, False) == forward
    assert bench_attention.flops(b, h, s, d, False, backward=True) == 2.5 * forward
    assert bench_attention.flops(b, h, s, d, True, backward=True) == 1.25 * forward


def test_rel_error_is_each_gradients_own_scale():
    want = [torch.tensor([1.0, -4.0]), torch.tensor([100.0, 0.0])]
    got = [torch.tensor([1.0, -3.9]), torch.tensor([100.0, 1.0])]
    # 0.1 of 4 for the first, 1 of 100 for the second: the worst is 0.025
    assert bench_attention.rel_error(got, want) == pytest.approx(0.025)
    assert bench_attention.rel_error(want, want) == 0.0
    assert bench_attention.rel_error([torch.ones(2)], [torch.zeros(2)]) > 1e20  # no scale


def test_side_by_side_row():
    row = bench_attention.side_by_side("B1 H1 S1 D64 full   bwd", 4e12, 1.0,
                                       [("sdpa-cudnn", 2.0), ("sdpa-flash", None)])
    assert row == ("B1 H1 S1 D64 full   bwd tilewire     4.0 TFLOP/s | sdpa-cudnn     2.0 "
                   "TFLOP/s, ratio 2.00 | sdpa-flash n/a")
    assert bench_attention._label((4, 16, 4096, 128), True, "fwd") == \
        "B4 H16 S4096 D128 causal fwd"


def test_pass_option(capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(["--pass", "sideways"])
    assert "--pass" in capsys.readouterr().err
