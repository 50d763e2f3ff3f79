"""The C int4 matmul (shard/kernels/int4_matmul.c) against the weights its 4-bit form stands for."""
import pytest
import torch

from shard.kernels import bf16_matmul, int4_matmul
from shard.layers.linear import LinearWeight, c_int4_runs, linear


@pytest.fixture(params=["native", "avx2"])
def int4_build(request):
    """The kernel as this CPU builds it, and as an AVX2-only CPU does (-march=x86-64-v3)."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
    int4_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()
    if int4_matmul.load_library() is None:
        int4_matmul.load_library.cache_clear()
        bf16_matmul.load_library.cache_clear()
        pytest.skip("the C int4 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    yield request.param
    int4_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()


def test_quantize_keeps_q4_1_weights():
    """Weights made as q * d + m per group of 32 (GGUF's Q4_1), each group using the whole 0..15
    range, come back as they were."""
    torch.manual_seed(0)
    n, k = 48, 96
    q = torch.randint(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    # scales and minimums as the file stores them (float16), widened as the GGUF reader does
    d = (torch.rand(n, k // 32) * 0.1 + 0.01).half().float()
    m = torch.randn(n, k // 32).half().float()
    weight = (q * d[..., None] + m[..., None]).reshape(n, k)
    codes, scale, low = int4_matmul.quantize(weight)
    assert torch.equal(codes.reshape(n, k // 32, 32).long(), q)
    assert torch.equal(low, m) and torch.equal(scale, d)
    assert torch.equal(int4_matmul.restore(codes, scale, low), weight)


def activation_rounding(x: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """[rows, n]: the most that rounding each input to 1/127 of its group's largest magnitude can
    move a product by restored weights (half a step per input, times the weight)."""
    rows, k = x.shape
    steps = x.double().reshape(rows, k // 32, 32).abs().amax(dim=-1) / 127
    weights = restored.abs().reshape(-1, k // 32, 32).sum(dim=-1)
    return (steps / 2) @ weights.T


@pytest.mark.parametrize("features", [(16, 32), (17, 64), (100, 96), (333, 576), (576, 1536)])
def test_the_kernel_multiplies_by_the_restored_weights(features, int4_build):
    """Every 4-bit tile (1, 2, 4, 8 rows; 1, 2 and 4 on AVX2, and passes of 256 rows there) and tail
    of a 16-feature block, with and without bias: within float32 rounding of the exact product by
    the restored weights, rounded once (on AVX2, by the rows rounded to int8)."""
    if int4_build == "avx2":
        assert int4_matmul.load_library().int4_matmul_supported() == int4_matmul.AVX2_FORM
    torch.manual_seed(1)
    avx2_form = int4_matmul.load_library().int4_matmul_supported() == int4_matmul.AVX2_FORM
    n, k = features
    codes, scale, low = int4_matmul.quantize(torch.randn(n, k))
    packed = int4_matmul.pack(codes, scale, low)
    restored = int4_matmul.restore(codes, scale, low).double()
    for bias in (None, torch.randn(n, dtype=torch.bfloat16)):
        for rows in (1, 2, 3, 4, 5, 7, 8, 13, 300):
            if rows > (int4_matmul.tile_rows() or 300):
                break
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            out = int4_matmul.matmul(x, packed, n, bias)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            exact = x.double() @ restored.T
            if bias is not None:
                exact += bias.double()
            # one bf16 rounding, plus the float32 sums (the 128 offset costs D ~7 bits), plus on
            # AVX2 each input's rounding to 1/127 of its group's largest magnitude (half of it)
            slack = (x.double().abs() @ restored.abs().T) * 2.0 ** -15
            bound = exact.abs() / 256 + slack
            if avx2_form:  # the bf16 rounding is of the result the rounded inputs give
                moved = activation_rounding(x, restored)
                bound += moved / 256 + moved
            assert bool(((out.double() - exact).abs() <= bound).all())
    # rows 2k apart, read in place (the C step's buffers could be), and float32 activations
    library = int4_matmul.load_library()
    rows = torch.randn(3, 2 * k, dtype=torch.bfloat16)
    strided = torch.empty(3, n, dtype=torch.bfloat16)
    assert library.int4_matmul(rows.data_ptr(), 3, k, 2 * k, packed.data_ptr(), n, None,
                               strided.data_ptr(), n) == 0
    assert torch.equal(strided, int4_matmul.matmul(rows[:, :k].contiguous(), packed, n, None))
    assert int4_matmul.matmul(rows[:, :k].float(), packed, n, None).dtype == torch.float32


@pytest.mark.parametrize("features", [(16, 32), (17, 64), (100, 96), (333, 576), (576, 1536)])
def test_larger_batches_are_the_bf16_matmul_on_the_restored_weights(features, int4_build):
    """Past the 4-bit tiles' rows, blocks unpacked on the fly: the bf16 of the restored weights bit
    for bit (an identity's rows read them back), and so every result the bf16 matmul gives on
    them (each of its tiles, passes of 256 rows). Not on AVX2: its integer tiles take every
    batch."""
    if int4_matmul.tile_rows() is None:
        pytest.skip("AVX2: every batch multiplies by the 4-bit tiles")
    torch.manual_seed(3)
    n, k = features
    weight = torch.randn(n, k) * 0.05
    weight[0, :32] = torch.linspace(0, 1e-39, 32)  # a subnormal minimum
    weight[-1, -32:] = 0  # a group of zeros: the smallest scale
    codes, scale, low = int4_matmul.quantize(weight)
    packed = int4_matmul.pack(codes, scale, low)
    restored = int4_matmul.restore(codes, scale, low).bfloat16()
    # an identity's rows, repeated past the tiles' rows
    eyes = torch.eye(k, dtype=torch.bfloat16).repeat(int4_matmul.tile_rows() // k + 1, 1)
    read_back = int4_matmul.matmul(eyes, packed, n, None)
    assert torch.equal(read_back, restored.T.repeat(len(eyes) // k, 1))
    bf16 = bf16_matmul.pack(restored)
    for bias in (None, torch.randn(n, dtype=torch.bfloat16)):
        tiles = int4_matmul.tile_rows()
        for rows in sorted({tiles + 1, tiles + 7, 23, 24, 31, 130, 300} - set(range(tiles + 1))):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            assert torch.equal(int4_matmul.matmul(x, packed, n, bias),
                               bf16_matmul.matmul(x, bf16, n, bias))


def test_int4_layers_hold_the_4_bit_form_alone():
    if int4_matmul.load_library() is None or not c_int4_runs():
        pytest.skip("our bf16 matmul does not run here")
    torch.manual_seed(2)
    weight, bias = torch.randn(64, 96), torch.randn(64, dtype=torch.bfloat16)
    prepared = LinearWeight.prepare(weight, bias, quantize_kind="int4",
                                    model_dtype=torch.bfloat16)
    assert prepared.quantized.kernel == "c" and prepared.multiplies_quantized
    assert prepared.weight is None and prepared.tiled is None and prepared.packed is None
    assert (prepared.out_features, prepared.in_features) == (64, 96)
    restored = int4_matmul.restore(*int4_matmul.quantize(weight)).bfloat16()
    tiles = int4_matmul.tile_rows()
    for rows in (1, tiles or 8, (tiles or 8) + 1, 40):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        out = linear(x, prepared)
        assert torch.equal(out, int4_matmul.matmul(x, prepared.quantized.data, 64, bias))
        if tiles is not None and rows > tiles:
            assert torch.equal(out, linear(x, LinearWeight.prepare(restored, bias)))


def test_rows_of_a_width_the_kernel_does_not_take_are_a_value_error(int4_build):
    """The kernel refuses inputs that are not whole groups of 32 (-1): a ValueError, not the
    MemoryError of scratch it could not allocate."""
    packed = int4_matmul.pack(*int4_matmul.quantize(torch.randn(16, 64)))
    for rows in (2, 40):  # the 4-bit tiles and the unpacked blocks
        with pytest.raises(ValueError):
            int4_matmul.matmul(torch.randn(rows, 48, dtype=torch.bfloat16), packed, 16, None)


def test_a_row_with_an_infinity_or_a_nan_leaves_the_other_rows_alone(int4_build):
    """Non-finite inputs give non-finite outputs in their own row (as a float product would; on
    AVX2 their groups' int8 rounding carries a NaN), and every other row is what it is alone."""
    torch.manual_seed(5)
    packed = int4_matmul.pack(*int4_matmul.quantize(torch.randn(32, 64)))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[1, 3], x[2, 40] = float("inf"), float("nan")
    x[3, :32] = 1e-40  # subnormal: a group this small still rounds (127 / 1e-40 would not)
    out = int4_matmul.matmul(x, packed, 32, None)
    assert not out[1:3].isfinite().any() and out[3].isfinite().all()
    for row in (0, 3):
        assert torch.equal(out[row], int4_matmul.matmul(x[row:row + 1], packed, 32, None)[0])
