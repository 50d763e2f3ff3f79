"""The C int8 matmul (shard/kernels/int8_matmul.c) against the weights its groups stand for."""
import shutil

import numpy as np
import pytest
import torch

from shard.config import c_compiler, kernel_enabled
from shard.kernels import bf16_matmul, int8_matmul
from shard.layers import ggml_quants

ROWS = (1, 2, 3, 5, 8, 17, 33, 100, 300)


@pytest.fixture(params=["native", "avx2", "no-vnni"])
def int8_build(request):
    """The kernel as this CPU builds it, as an AVX2-only CPU does (-march=x86-64-v3), and as an
    AVX-512 BF16 CPU without VNNI would."""
    if request.param in ("avx2", "no-vnni"):
        request.getfixturevalue(f"{request.param.replace('-', '_')}_build")
    int8_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()
    if int8_matmul.load_library() is None:
        int8_matmul.load_library.cache_clear()
        bf16_matmul.load_library.cache_clear()
        # a CPU that runs this form has it built, unless no compiler exists or it is off
        assert request.param != "no-vnni" or shutil.which(c_compiler()) is None \
            or not kernel_enabled(int8_matmul.ENABLED_ENV)
        pytest.skip("the C int8 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    # the form without VNNI is the one with tiles up to a bound (larger batches unpacked)
    assert request.param != "no-vnni" or int8_matmul.tile_rows() is not None
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
          rounded_to: int | None, bf16_weights: bool) -> torch.Tensor:
    """[rows, n]: how far the kernel's result may lie from the exact product, and why.

    S = |x| (|q scale| + |low|): the magnitude of what is summed (q scale and low may cancel, as
    Q5_0's q * d - 16 d does). Float32 sums: one multiply-add per group for each factor, k / group
    groups, bounded by (group + k / group + 8) 2^-24 S (each group's dot product is exact in
    int32, so this is loose). The rows rounded to int16 (`rounded_to` 32767: AVX-512 without
    VNNI), or to int8 (127: VNNI and AVX2, as llama.cpp rounds its activations):
    half of 1/rounded_to of each group's largest input, times the group's |w|. Past the tiles,
    the weights rounded to bf16 (2^-9 each) and the bf16 matmul's float32 sums (k 2^-24). Then
    the result's one rounding to bf16: half a unit, 2^-8 of its magnitude at most."""
    rows, k = x.shape
    wide = x.double()
    terms = ((q.double() * scale.double().repeat_interleave(group, 1)).abs()
             + low.double().abs().repeat_interleave(group, 1))
    slack = (group + k // group + 8) * 2.0 ** -24 * (wide.abs() @ terms.T)
    if rounded_to:
        steps = wide.reshape(rows, k // group, group).abs().amax(dim=-1) / rounded_to
        weights = int8_matmul.restore(q, scale, low, group).double().abs()
        slack += (steps / 2) @ weights.reshape(-1, k // group, group).sum(dim=-1).T
    if bf16_weights:
        weights = int8_matmul.restore(q, scale, low, group).double().abs()
        slack += (2.0 ** -9 + k * 2.0 ** -24) * (wide.abs() @ weights.T)
    return (exact.abs() + slack) * 2.0 ** -8 + slack


def rounded_to(rows: int, tiles: int) -> int | None:
    """The integer the kernel rounds each group's largest input to at this many rows, or None."""
    form = int8_matmul.load_library().int8_matmul_supported()
    if form in (int8_matmul.VNNI_FORM, int8_matmul.AVX2_FORM):
        return 127
    return 32767 if form == int8_matmul.DPBF16_FORM and rows <= tiles else None


@pytest.mark.parametrize("group", [16, 32])
def test_the_kernel_multiplies_by_the_restored_weights(group, int8_build):
    """Every tile (1, 2, 4, 8 rows on AVX-512; 1, 2, 4 on AVX2; passes of rows), every tail
    of a 16-feature block, with and without bias, rows a column slice of a wider tensor: within
    `bound` of the exact product by the restored weights; where the tiles take every batch, a
    row's result is what it is alone."""
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
                                    rounded_to=rounded_to(rows, tiles),
                                    bf16_weights=rows > tiles)
                    assert bool(((out.double() - exact).abs() <= allowed).all()), (n, k, rows)
                    if int8_matmul.tile_rows() is None and rows > 1:  # any batch: as alone
                        assert torch.equal(out[-1:], int8_matmul.matmul(x[-1:], packed, n, bias))


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
        pytest.skip("AVX2, AVX-512 VNNI: every batch multiplies by the 8-bit tiles")
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


# the compact factor modes, with the group each holds GGUF's types in
COMPACT = {"H": 32, "H16": 16, "HL": 32, "HL16": 16, "K6": 16, "K5": 32}


def halves(shape, generator, spread: float = 0.01) -> torch.Tensor:
    """Random float16 factors (positive and negative, none subnormal)."""
    values = torch.rand(shape, generator=generator) * spread + 1e-4
    signs = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return (values * signs).half()


def compact(mode: str, n: int, k: int, seed: int):
    """Random GGUF-like factors of `mode` packed: (packed, q, scale, low, group, restored), scale
    and low the float32 factors they stand for (what mode F would hold)."""
    generator = torch.Generator().manual_seed(seed)
    group = COMPACT[mode]
    if mode.startswith("H"):  # Q8_0 (q -128..127), Q5_0 (q - 16), Q5_1 (q 0..31, a low)
        q = torch.randint(-128, 128, (n, k), dtype=torch.int16, generator=generator)
        q[:, 0], q[:, -1] = -128, 127
        scale = halves((n, k // group), generator)
        low = halves((n, k // group), generator, 0.1) if mode.startswith("HL") else None
        packed = int8_matmul.pack_half(q, scale, group, low=low)
        restored = int8_matmul.restore_half(q, scale, group, low=low)
        low32 = torch.zeros(n, k // group) if low is None else low.float()
        return packed, q, scale.float(), low32, group, restored
    d = halves((n, k // 256), generator, 0.001).float()
    if mode == "K6":
        q = torch.randint(-32, 32, (n, k), dtype=torch.int16, generator=generator)
        q[:, 0], q[:, -1] = -32, 31
        sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=generator)
        sc[:, 0], sc[:, -1] = -128, 127
        return (int8_matmul.pack_k6(q, d, sc), q, int8_matmul.k6_scale(d, sc),
                torch.zeros(n, k // 16), 16, int8_matmul.restore_k6(q, d, sc))
    q = torch.randint(0, 32, (n, k), dtype=torch.int16, generator=generator)
    q[:, 0], q[:, -1] = 0, 31
    d = d.abs()
    dmin = halves((n, k // 256), generator, 0.001).float().abs()
    sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator)
             for _ in range(2))
    scale, low = int8_matmul.k5_factors(d, sc, dmin, m)
    return (int8_matmul.pack_k5(q, d, sc, dmin, m), q, scale, low, 32,
            int8_matmul.restore_k5(q, d, sc, dmin, m))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 bit for bit (a -0 is not a +0)."""
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


@pytest.mark.parametrize("mode", list(COMPACT))
def test_compact_modes_restore_what_their_float32_factors_do_in_fewer_bytes(mode, int8_build):
    """Each mode's `restore` is the float32 factors' (q * scale, rounded, + low), its header
    records group, k, n and mode, and its bytes a weight are 8 bits plus the compact factors'."""
    n, k = 40, 512
    packed, q, scale, low, group, restored = compact(mode, n, k, seed=10)
    assert torch.equal(restored, int8_matmul.restore(q, scale, low, group))
    header = packed[:64].view(torch.int64)[:5].tolist()
    modes = {"H": int8_matmul.MODE_H, "HL": int8_matmul.MODE_HL, "K6": int8_matmul.MODE_K6,
             "K5": int8_matmul.MODE_K5}
    assert header[1:] == [group, k, n, modes[mode.removesuffix("16")]]
    factor_bits = {"H": 16 / 32, "H16": 16 / 16, "HL": 32 / 32, "HL16": 32 / 16,
                   "K6": 8 / 16 + 32 / 256, "K5": 16 / 32 + 64 / 256}[mode]
    assert (packed.numel() - 64) * 8 == 48 * k * (8 + factor_bits)  # 48: n in whole blocks


@pytest.mark.parametrize("mode", list(COMPACT))
def test_compact_modes_multiply_by_their_restored_weights(mode, int8_build):
    """Every tile and path, tails of a block, bias or none: within `bound` of the exact product
    by the restored weights, as mode F is."""
    tiles = int8_matmul.tile_rows() or max(ROWS)
    generator = torch.Generator().manual_seed(11)
    for n in (16, 40):
        for k in (256, 512):
            packed, q, scale, low, group, restored = compact(mode, n, k, seed=n + k)
            for bias in (None, torch.randn(n, generator=generator).bfloat16()):
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=generator).bfloat16()
                    out = int8_matmul.matmul(x, packed, n, bias)
                    exact = x.double() @ restored.double().T
                    if bias is not None:
                        exact += bias.double()
                    allowed = bound(x, q, scale, low, group, exact,
                                    rounded_to=rounded_to(rows, tiles),
                                    bf16_weights=rows > tiles)
                    assert bool(((out.double() - exact).abs() <= allowed).all()), (n, k, rows)


@pytest.mark.parametrize("mode", list(COMPACT))
def test_compact_modes_past_the_tiles_are_the_bf16_matmul_on_the_restored_weights(mode,
                                                                                  int8_build):
    """The unpacked blocks of every mode: bit for bit the bf16 matmul's on the bf16 of `restore`'s
    weights (not on AVX2: its tiles take every batch)."""
    tiles = int8_matmul.tile_rows()
    if tiles is None:
        pytest.skip("AVX2, AVX-512 VNNI: every batch multiplies by the 8-bit tiles")
    generator = torch.Generator().manual_seed(12)
    for n, k in ((40, 256), (200, 512)):
        packed, *_, restored = compact(mode, n, k, seed=n * k)
        bf16 = bf16_matmul.pack(restored.bfloat16())
        for bias in (None, torch.randn(n, generator=generator).bfloat16()):
            for rows in (tiles + 1, 300):
                x = torch.randn(rows, k, generator=generator).bfloat16()
                assert torch.equal(int8_matmul.matmul(x, packed, n, bias),
                                   bf16_matmul.matmul(x, bf16, n, bias))


def test_a_compact_header_for_another_shape_or_mode_is_a_value_error(int8_build):
    """k, n, a mode the kernel does not know, or a superblock mode at another group: refused."""
    packed = compact("K6", 32, 512, seed=13)[0]
    for rows in (2, 200):
        x = torch.randn(rows, 512).bfloat16()
        assert int8_matmul.matmul(x, packed, 32, None).shape == (rows, 32)
        with pytest.raises(ValueError):
            int8_matmul.matmul(x, packed, 16, None)
        with pytest.raises(ValueError):
            int8_matmul.matmul(torch.randn(rows, 256).bfloat16(), packed, 32, None)
        for at, value in ((4, 9), (4, -1), (1, 32)):  # mode 9, mode -1, K6 in groups of 32
            altered = packed.clone()
            altered[:64].view(torch.int64)[at] = value
            with pytest.raises(ValueError):
                int8_matmul.matmul(x, altered, 32, None)


def test_compact_packs_refuse_what_their_modes_cannot_hold(int8_build):
    generator = torch.Generator().manual_seed(14)
    q = torch.randint(-32, 32, (16, 256), generator=generator)
    d, sc = torch.ones(16, 1), torch.ones(16, 16, dtype=torch.int8)
    with pytest.raises(ValueError):
        int8_matmul.pack_k6(q + 32, d, sc)  # past 31
    with pytest.raises(ValueError):
        int8_matmul.pack_k6(q[:, :128], d, sc[:, :8])  # not whole superblocks
    with pytest.raises(ValueError):
        int8_matmul.pack_half(q, torch.ones(16, 8), 32)  # float32, not float16 scales
    with pytest.raises(ValueError):
        int8_matmul.pack_k5(q + 32, d, sc.view(torch.uint8)[:, :8], d,
                            sc.view(torch.uint8)[:, :8])  # past 31, and not 0..31


def random_blocks(kind: str, count: int, seed: int) -> torch.Tensor:
    """`count` random blocks of a GGUF type: random bytes, float16 fields finite and normal."""
    rng = np.random.default_rng(seed)
    block = ggml_quants.BLOCK_TYPES[kind].block_bytes
    data = rng.integers(0, 256, (count, block), dtype=np.uint8)
    fields = {"Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind]
    for at in fields:
        values = rng.uniform(1e-4, 0.01, count) * rng.choice([-1, 1], count)
        data[:, at:at + 2] = values.astype(np.float16).view(np.uint8).reshape(count, 2)
    return torch.from_numpy(data)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q6_K", "Q5_K"])
def test_compact_factors_of_gguf_blocks_restore_gguf_dequantization(kind, int8_build):
    """A GGUF type's own bytes taken apart into a mode's q and compact factors: `restore` and
    the unpacked kernel's weights are `gguf`'s dequantization, bit for bit."""
    gguf = pytest.importorskip("gguf")
    n, k = 16, 512
    data = random_blocks(kind, n * k // ggml_quants.BLOCK_TYPES[kind].block_values, seed=15)
    expected = torch.from_numpy(gguf.quants.dequantize(
        data.reshape(n, -1).numpy(), gguf.GGMLQuantizationType[kind]).copy())
    q = ggml_quants.groups_of(kind, data.reshape(n, -1), k).q
    half = lambda at: data[:, at:at + 2].contiguous().view(torch.float16)  # noqa: E731
    if kind in ("Q8_0", "Q5_0", "Q5_1"):
        q = q - 16 if kind == "Q5_0" else q
        low = half(2).reshape(n, -1) if kind == "Q5_1" else None
        restored = int8_matmul.restore_half(q, half(0).reshape(n, -1), 32, low=low)
        packed = int8_matmul.pack_half(q, half(0).reshape(n, -1), 32, low=low)
    elif kind == "Q6_K":
        d = half(208).float().reshape(n, -1)
        sc = data[:, 192:208].contiguous().view(torch.int8).reshape(n, -1)
        restored, packed = int8_matmul.restore_k6(q, d, sc), int8_matmul.pack_k6(q, d, sc)
    else:
        d, dmin = half(0).float().reshape(n, -1), half(2).float().reshape(n, -1)
        sc, m = (f.reshape(n, -1) for f in ggml_quants.scale_min(data[:, 4:16]))
        restored = int8_matmul.restore_k5(q, d, sc, dmin, m)
        packed = int8_matmul.pack_k5(q, d, sc, dmin, m)
    assert same_bits(restored, expected)
    tiles = int8_matmul.tile_rows()
    if tiles is not None:  # the unpacked blocks: each weight's bf16 (an identity x picks them)
        x = torch.eye(k, dtype=torch.bfloat16)[:tiles + 1]
        assert torch.equal(int8_matmul.matmul(x, packed, n, None),
                           expected.bfloat16().T[:tiles + 1])


@pytest.mark.parametrize("mode", ["F16", "F32", *COMPACT])
def test_rows_of_the_packed_form_are_the_restored_weights_rows(mode, int8_build):
    """A tied GGUF's embedding rows, read from the head's packed form: `restore`'s, exactly, for
    any ids (repeated, unordered, in the last partial block)."""
    n, k = 40, 512
    if mode.startswith("F"):
        group = int(mode[1:])
        q, scale, low = groups(n, k, group, seed=5)
        packed, restored = int8_matmul.pack(q, scale, low, group), \
            int8_matmul.restore(q, scale, low, group)
    else:
        packed, *_, restored = compact(mode, n, k, seed=6)
    ids = torch.tensor([39, 0, 17, 17, 32, 5, 38])
    assert torch.equal(int8_matmul.rows(packed, ids), restored[ids])
    many = torch.randint(0, n, (600,), generator=torch.Generator().manual_seed(7))  # in parts
    assert torch.equal(int8_matmul.rows(packed, many), restored[many])
    assert int8_matmul.rows(packed, torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError):
        int8_matmul.rows(packed, torch.tensor([40]))
