"""tilewire.attention's argument checks, which need torch but no GPU (CPU tensors): each bad
argument raises TypeError / ValueError naming it before anything reaches the library.
Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
from tilewire import _attention  # noqa: E402

bf16 = torch.bfloat16


def _qkv(b=2, sq=77, sk=300, hq=8, hk=2, d=128, dtype=bf16):
    q = torch.zeros(b, sq, hq, d, dtype=dtype)
    k = torch.zeros(b, sk, hk, d, dtype=dtype)
    return q, k, torch.zeros_like(k)


def _check(q, k, v, causal=False, softmax_scale=None, q_offset=0, kv_offset=0):
    return _attention._check_attention(q, k, v, causal, softmax_scale, q_offset, kv_offset)


def test_exported():
    assert tilewire.attention is _attention.attention
    assert "attention" in tilewire.__all__


def test_good_shapes_pass():
    assert _check(*_qkv()) == (2, 77, 8, 300, 2, 128)
    assert _check(*_qkv(d=64, hk=8), causal=True, softmax_scale=0.1, q_offset=5,
                  kv_offset=3) == (2, 77, 8, 300, 8, 64)


@pytest.mark.parametrize("kwargs, err, needle", [
    (dict(d=96), ValueError, "head_dim"),
    (dict(d=256), ValueError, "head_dim"),
    (dict(hq=6, hk=4), ValueError, "heads_q"),
    (dict(sq=0), ValueError, "empty"),
    (dict(dtype=torch.float16), TypeError, "q must be"),
])
def test_bad_shapes(kwargs, err, needle):
    with pytest.raises(err, match=needle):
        _check(*_qkv(**kwargs))


def test_bad_tensors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        _check(None, k, v)
    with pytest.raises(ValueError, match="k must be 4-D"):
        _check(q, k[0], v)
    with pytest.raises(ValueError, match="v must be contiguous"):
        _check(q, k, torch.zeros(2, 2, 300, 128, dtype=bf16).transpose(1, 2))
    with pytest.raises(ValueError, match="same shape"):
        _check(q, k, v[:, :10].contiguous())
    with pytest.raises(ValueError, match="batch and head_dim"):
        _check(q, k[:1], v[:1])
    with pytest.raises(TypeError, match="v must be"):
        _check(q, k, v.float())


@pytest.mark.parametrize("kwargs, err, needle", [
    (dict(causal=1), TypeError, "causal"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    (dict(q_offset=-1), ValueError, "q_offset"),
    (dict(kv_offset=1.5), TypeError, "kv_offset"),
    (dict(kv_offset=1 << 63), ValueError, "kv_offset"),
])
def test_bad_options(kwargs, err, needle):
    with pytest.raises(err, match=needle):
        _check(*_qkv(), **kwargs)


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        tilewire.attention(*_qkv())


def test_bench_shapes_and_flops():
    from tilewire import bench_attention

    assert bench_attention.parse_shape("4,16,4096,128") == (4, 16, 4096, 128)
    with pytest.raises(Exception, match="B,H,S,D"):
        bench_attention.parse_shape("4,16,4096")
    assert bench_attention.flops(4, 16, 4096, 128, False) == 4.0 * 4 * 16 * 4096 ** 2 * 128
    assert bench_attention.flops(4, 16, 4096, 128, True) == 2.0 * 4 * 16 * 4096 ** 2 * 128


def test_custom_ops_mutate_o_and_lse():
    import re

    for op in (torch.ops.tilewire.attention, torch.ops.tilewire.ring_attention):
        schema = str(op.default._schema)
        assert re.search(r"Tensor\(a\d*!\) o", schema) and re.search(r"Tensor\(a\d*!\) lse",
                                                                      schema), schema
    q, k, v = _qkv()
    assert _attention._attention_fake(q, k, v, torch.empty_like(q), torch.empty(0), True, 0.0,
                                      0, 0) is None
