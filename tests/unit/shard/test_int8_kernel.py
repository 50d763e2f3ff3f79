"""The C int8 matmul (shard/kernels/int8_matmul.c) against the weights its groups stand for."""
import pytest
import torch

from shard.kernels import bf16_matmul, int8_matmul

ROWS = (1, 2, 3, 5, 8, 17, 33, 100, 300)


@pytest.fixture(params=["native", "avx2"])
def int8_build(request):
    """The kernel as this CPU builds it, and as an AVX2-only CPU does (-march=x86-64-v3)."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
    int8_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()
    if int8_matmul.load_library() is None:
        int8_matmul.load_library.cache_clear()
        bf16_matmul.load_library.cache_clear()
        pytest.skip("the C int8 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    yield request.param
    int8_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()


def groups(n: int, k: int, group: int, seed: int):
    """Random (q, scale, low) as GGUF stores them: q int16 in -128..127 with both ends present,
    factors float16 values (so no restored weight is subnormal), some lows 0 (Q8_0, Q6_K)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int16, generator=generator)
    q[:, 0], q[:, -1] = -128, 127
    scale = (torch.rand(n, k // group, generator=generator) * 0.01 + 1e-4).half().float()
    low = (torch.randn(n, k // group, generator=generator) * 0.1).half().float()
    low[::2] = 0
    return q, scale, low


def unpacked(packed: torch.Tensor, n: int, k: int, group: int):
    """The packed layout read back in Python: (q, scale, low) and the header."""
    header = packed[:64].view(torch.int64)[:4].tolist()
    blocks, count = (n + 15) // 16, k // group
    body = packed[64:].reshape(blocks, count, 16 * group + 128)
    # [blocks, groups, pairs, 16 features, 2 inputs] -> [blocks, 16, groups, pairs, 2]
    q = body[..., :16 * group].contiguous().view(torch.int8).reshape(blocks, count, group // 2,
                                                                     16, 2)
    q = q.permute(0, 3, 1, 2, 4).reshape(blocks * 16, k)
    factors = body[..., 16 * group:].contiguous().view(torch.float32).reshape(blocks, count, 2,
                                                                              16)
    scale, low = (factors[:, :, j].permute(0, 2, 1).reshape(blocks * 16, count) for j in (0, 1))
    return header, q, scale, low


@pytest.mark.parametrize("group", [16, 32])
def test_pack_keeps_every_value_and_restore_is_q_times_scale_plus_low(group, int8_build):
    """The packed bytes hold q (both ends of -128..127), scale and low as given, padding features
    zeros; `restore` is the float32 product rounded, then the sum."""
    n, k = 40, 96
    q, scale, low = groups(n, k, group, seed=0)
    packed = int8_matmul.pack(q, scale, low, group)
    header, codes, scales, lows = unpacked(packed, n, k, group)
    assert header[1:] == [group, k, n]
    assert torch.equal(codes[:n].short(), q) and not codes[n:].any()
    assert torch.equal(scales[:n], scale) and torch.equal(lows[:n], low)
    assert not scales[n:].any() and not lows[n:].any()
    assert torch.equal(int8_matmul.pack(q.to(torch.int8), scale, low, group), packed)
    restored = int8_matmul.restore(q, scale, low, group)
    expanded = (q.float() * scale.repeat_interleave(group, 1)) + low.repeat_interleave(group, 1)
    assert torch.equal(restored, expanded)


def bound(x: torch.Tensor, q, scale, low, group: int, exact: torch.Tensor,
          int16_rows: bool, bf16_weights: bool) -> torch.Tensor:
    """[rows, n]: how far the kernel's result may lie from the exact product, and why.

    S = |x| (|q scale| + |low|): the magnitude of what is summed (q scale and low may cancel, as
    Q5_0's q * d - 16 d does). Float32 sums: AVX2 a group's dot product of `group` terms, then
    one multiply-add per group for each factor, k / group groups: (group + k / group + 8) 2^-24 S
    (on AVX-512 the dot product is exact in int32, so this is looser). AVX-512's rows rounded to
    int16: half of 1/32767 of each group's largest input, times the group's |w|. Past the tiles,
    the weights rounded to bf16 (2^-9 each) and the bf16 matmul's float32 sums (k 2^-24). Then
    the result's one rounding to bf16: half a unit, 2^-8 of its magnitude at most."""
    rows, k = x.shape
    wide = x.double()
    terms = ((q.double() * scale.double().repeat_interleave(group, 1)).abs()
             + low.double().abs().repeat_interleave(group, 1))
    slack = (group + k // group + 8) * 2.0 ** -24 * (wide.abs() @ terms.T)
    if int16_rows:
        steps = wide.reshape(rows, k // group, group).abs().amax(dim=-1) / 32767
        weights = int8_matmul.restore(q, scale, low, group).double().abs()
        slack += (steps / 2) @ weights.reshape(-1, k // group, group).sum(dim=-1).T
    if bf16_weights:
        weights = int8_matmul.restore(q, scale, low, group).double().abs()
        slack += (2.0 ** -9 + k * 2.0 ** -24) * (wide.abs() @ weights.T)
    return (exact.abs() + slack) * 2.0 ** -8 + slack


@pytest.mark.parametrize("group", [16, 32])
def test_the_kernel_multiplies_by_the_restored_weights(group, int8_build):
    """Every tile (1, 2, 4, 8 rows on AVX-512; 1-3 rows and passes of 128 on AVX2), every tail
    of a 16-feature block, with and without bias, rows a column slice of a wider tensor: within
    `bound` of the exact product by the restored weights."""
    avx2_form = int8_matmul.load_library().int8_matmul_supported() == int8_matmul.AVX2_FORM
    assert avx2_form == (int8_build == "avx2") or int8_build == "native"
    tiles = int8_matmul.tile_rows() or max(ROWS)
    generator = torch.Generator().manual_seed(1)
    for n in (16, 40, 200):
        for k in (32, 96, 512):
            q, scale, low = groups(n, k, group, seed=n + k)
            packed = int8_matmul.pack(q, scale, low, group)
            restored = int8_matmul.restore(q, scale, low, group).double()
            for bias in (None, torch.randn(n, generator=generator).bfloat16()):
                for rows in ROWS:
                    wider = torch.randn(rows, k + 24, generator=generator).bfloat16()
                    x = wider[:, 8:8 + k]
                    out = int8_matmul.matmul(x, packed, n, bias)
                    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
                    exact = x.double() @ restored.T
                    if bias is not None:
                        exact += bias.double()
                    allowed = bound(x, q, scale, low, group, exact,
                                    int16_rows=not avx2_form and rows <= tiles,
                                    bf16_weights=rows > tiles)
                    assert bool(((out.double() - exact).abs() <= allowed).all()), (n, k, rows)


@pytest.mark.parametrize("rows", [3, 200])
def test_rows_and_results_strided_in_place(rows, int8_build):
    """The C call reads rows x_stride > k apart and writes out_stride > n apart (the C step's
    buffers could be), as the contiguous call gives, touching nothing between the rows."""
    n, k, group = 40, 96, 16
    packed = int8_matmul.pack(*groups(n, k, group, seed=4), group)
    wide = torch.randn(rows, k + 40).bfloat16()
    out = torch.full((rows, n + 8), 7.0, dtype=torch.bfloat16)
    library = int8_matmul.load_library()
    assert library.int8_matmul(wide.data_ptr(), rows, k, k + 40, packed.data_ptr(), n, None,
                               out.data_ptr(), n + 8) == 0
    assert torch.equal(out[:, :n], int8_matmul.matmul(wide[:, :k].contiguous(), packed, n, None))
    assert bool((out[:, n:] == 7.0).all())


@pytest.mark.parametrize("group", [16, 32])
def test_larger_batches_are_the_bf16_matmul_on_the_restored_weights(group, int8_build):
    """Past the 8-bit tiles' rows, blocks unpacked on the fly: bit for bit what the bf16 matmul
    gives on the bf16 of the restored weights (each of its tiles, passes of 256 rows). Not on
    AVX2: its tiles take every batch."""
    tiles = int8_matmul.tile_rows()
    if tiles is None:
        pytest.skip("AVX2: every batch multiplies by the 8-bit tiles")
    generator = torch.Generator().manual_seed(3)
    for n, k in ((40, 96), (200, 512)):
        q, scale, low = groups(n, k, group, seed=n * k)
        packed = int8_matmul.pack(q, scale, low, group)
        bf16 = bf16_matmul.pack(int8_matmul.restore(q, scale, low, group).bfloat16())
        for bias in (None, torch.randn(n, generator=generator).bfloat16()):
            for rows in (tiles + 1, tiles + 7, 300):
                x = torch.randn(rows, k, generator=generator).bfloat16()
                assert torch.equal(int8_matmul.matmul(x, packed, n, bias),
                                   bf16_matmul.matmul(x, bf16, n, bias))


def test_a_header_for_another_shape_is_a_value_error(int8_build):
    """The kernel checks the packed header against k and n (-1): a ValueError, not the
    MemoryError of scratch it could not allocate, at every batch size."""
    packed = int8_matmul.pack(*groups(32, 64, 32, seed=5), 32)
    for rows in (2, 200):  # the 8-bit tiles and the unpacked blocks
        x = torch.randn(rows, 64).bfloat16()
        with pytest.raises(ValueError):
            int8_matmul.matmul(x, packed, 16, None)  # another n
        with pytest.raises(ValueError):
            int8_matmul.matmul(torch.randn(rows, 32).bfloat16(), packed, 32, None)  # another k
        with pytest.raises(ValueError):
            int8_matmul.matmul(x, torch.zeros_like(packed), 32, None)  # not a packed weight


def test_pack_refuses_what_the_kernel_cannot_hold(int8_build):
    q, scale, low = groups(16, 64, 32, seed=6)
    with pytest.raises(ValueError):
        int8_matmul.pack(q, scale, low, 64)  # groups of 16 or 32 only
    with pytest.raises(ValueError):
        int8_matmul.pack(q[:, :48], scale, low, 32)  # not whole groups
    with pytest.raises(ValueError):
        int8_matmul.pack(q + 128, scale, low, 32)  # past 127


def test_a_row_with_an_infinity_or_a_nan_leaves_the_other_rows_alone(int8_build):
    """Non-finite inputs give non-finite outputs in their own row (as a float product would; on
    AVX-512 their groups' int16 rounding carries a NaN), and every other row is what it is alone,
    subnormal inputs included."""
    packed = int8_matmul.pack(*groups(32, 64, 16, seed=7), 16)
    x = torch.randn(4, 64).bfloat16()
    x[1, 3], x[2, 40] = float("inf"), float("nan")
    x[3, :16] = 1e-40  # subnormal: a group this small still rounds (32767 / 1e-40 would not)
    out = int8_matmul.matmul(x, packed, 32, None)
    assert not out[1:3].isfinite().any() and out[3].isfinite().all()
    for row in (0, 3):
        assert torch.equal(out[row], int8_matmul.matmul(x[row:row + 1], packed, 32, None)[0])
