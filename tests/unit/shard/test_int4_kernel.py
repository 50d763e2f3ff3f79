"""The C int4 matmul (shard/kernels/int4_matmul.c) against the weights its 4-bit form stands for."""
import shutil

import numpy as np
import pytest
import torch

from shard.config import c_compiler, kernel_enabled
from shard.kernels import bf16_matmul, int4_matmul
from shard.layers import ggml_quants
from shard.layers.linear import LinearWeight, c_int4_runs, linear

# the factor modes: F (float32, `quantize`'s), K (Q4_K's), H (float16: Q4_0's low -8d, Q4_1's)
MODES = ["F", "K", "Q4_0", "Q4_1"]
FEATURES = [(16, 32), (17, 64), (100, 96), (333, 576), (576, 1536)]


@pytest.fixture(params=["native", "avx2", "no-vnni"])
def int4_build(request):
    """The kernel as this CPU builds it, as an AVX2-only CPU does (-march=x86-64-v3), and as an
    AVX-512 BF16 CPU without VNNI would."""
    if request.param in ("avx2", "no-vnni"):
        request.getfixturevalue(f"{request.param.replace('-', '_')}_build")
    int4_matmul.load_library.cache_clear()
    bf16_matmul.load_library.cache_clear()
    if int4_matmul.load_library() is None:
        int4_matmul.load_library.cache_clear()
        bf16_matmul.load_library.cache_clear()
        # a CPU that runs this form has it built, unless no compiler exists or it is off
        assert request.param != "no-vnni" or shutil.which(c_compiler()) is None \
            or not kernel_enabled(int4_matmul.ENABLED_ENV)
        pytest.skip("the C int4 matmul needs AVX-512 BF16 or AVX2, and a C compiler")
    # the form without VNNI is the one with tiles up to a bound (larger batches unpacked)
    assert request.param != "no-vnni" or int4_matmul.tile_rows() is not None
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


def halves(*shape: int, size: float = 0.01) -> torch.Tensor:
    """Random float16 values (either sign, some subnormal at small sizes) as float16."""
    return (torch.randn(*shape) * size).half()


def compact_factors(mode: str, n: int, k: int) -> tuple:
    """Random 4-bit values and factors of a compact mode: (q, d, sc, dmin, m) of Q4_K (k whole
    superblocks), (q, scale, low) float16 of Q4_0 or Q4_1."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    if mode == "K":
        d, dmin = halves(n, k // 256).float(), halves(n, k // 256).float()
        sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8) for _ in range(2))
        return q, d, sc, dmin, m
    scale = halves(n, k // 32)
    low = (-8 * scale.float()).half() if mode == "Q4_0" else halves(n, k // 32, size=0.1)
    assert torch.equal(low.float(), -8 * scale.float()) or mode == "Q4_1"  # -8d exact in float16
    return q, scale, low


def packed_weight(mode: str, n: int, k: int,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A weight packed in `mode` and the float32 weights it stands for: (packed, restored, k), k
    rounded up to whole superblocks for K. F quantizes `weight` (random normal: None)."""
    if mode == "F":
        factors = int4_matmul.quantize(torch.randn(n, k) if weight is None else weight)
        return int4_matmul.pack(*factors), int4_matmul.restore(*factors), k
    if mode == "K":
        k = -(-k // 256) * 256
        factors = compact_factors(mode, n, k)
        return int4_matmul.pack_k(*factors), int4_matmul.restore_k(*factors), k
    factors = compact_factors(mode, n, k)
    return int4_matmul.pack_half(*factors), int4_matmul.restore_half(*factors), k


def activation_rounding(x: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """[rows, n]: the most that rounding each input to 1/127 of its group's largest magnitude can
    move a product by restored weights (half a step per input, times the weight)."""
    rows, k = x.shape
    steps = x.double().reshape(rows, k // 32, 32).abs().amax(dim=-1) / 127
    weights = restored.abs().reshape(-1, k // 32, 32).sum(dim=-1)
    return (steps / 2) @ weights.T


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("features", FEATURES)
def test_the_kernel_multiplies_by_the_restored_weights(features, mode, int4_build):
    """Every 4-bit tile (1, 2, 4, 8 rows; 1, 2 and 4 on AVX2; passes of 256 rows with integer
    tiles) and tail of a 16-feature block, with and without bias, in every mode: within float32
    rounding of the exact product by the restored weights, rounded once (with integer tiles, AVX2
    or AVX-512 VNNI, by the rows rounded to int8); and there each row's result is what it is alone,
    whatever the batch."""
    if int4_build == "avx2":
        assert int4_matmul.load_library().int4_matmul_supported() == int4_matmul.AVX2_FORM
    torch.manual_seed(1)
    avx2_form = int4_matmul.load_library().int4_matmul_supported() in (
        int4_matmul.AVX2_FORM, int4_matmul.VNNI_FORM)
    packed, restored, k = packed_weight(mode, *features)
    n, restored = features[0], restored.double()
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
            # integer tiles each input's rounding to 1/127 of its group's largest magnitude (half of it)
            slack = (x.double().abs() @ restored.abs().T) * 2.0 ** -15
            bound = exact.abs() / 256 + slack
            if avx2_form:  # the bf16 rounding is of the result the rounded inputs give
                moved = activation_rounding(x, restored)
                bound += moved / 256 + moved
            assert bool(((out.double() - exact).abs() <= bound).all())
            if avx2_form and rows > 1:
                for row in (0, rows - 1):
                    alone = int4_matmul.matmul(x[row:row + 1], packed, n, bias)
                    assert torch.equal(out[row:row + 1], alone)
    # rows 2k apart, read in place (the C step's buffers could be), and float32 activations
    library = int4_matmul.load_library()
    rows = torch.randn(3, 2 * k, dtype=torch.bfloat16)
    strided = torch.empty(3, n, dtype=torch.bfloat16)
    assert library.int4_matmul(rows.data_ptr(), 3, k, 2 * k, packed.data_ptr(), n, None,
                               strided.data_ptr(), n) == 0
    assert torch.equal(strided, int4_matmul.matmul(rows[:, :k].contiguous(), packed, n, None))
    assert int4_matmul.matmul(rows[:, :k].float(), packed, n, None).dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("features", FEATURES)
def test_larger_batches_are_the_bf16_matmul_on_the_restored_weights(features, mode, int4_build):
    """Past the 4-bit tiles' rows, blocks unpacked on the fly: the bf16 of the restored weights bit
    for bit (an identity's rows read them back), and so every result the bf16 matmul gives on
    them (each of its tiles, passes of 256 rows), in every mode. Not on AVX2 or AVX-512 VNNI: their
    integer tiles take every batch."""
    if int4_matmul.tile_rows() is None:
        pytest.skip("integer tiles (AVX2, AVX-512 VNNI): every batch multiplies by the 4-bit form")
    torch.manual_seed(3)
    n, k = features
    weight = torch.randn(n, k) * 0.05
    weight[0, :32] = torch.linspace(0, 1e-39, 32)  # a subnormal minimum
    weight[-1, -32:] = 0  # a group of zeros: the smallest scale
    packed, restored, k = packed_weight(mode, n, k, weight)
    restored = restored.bfloat16()
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


MAGIC = int.from_bytes(b"INT4PACK", "little")
MODE_OF = {"F": int4_matmul.MODE_F, "K": int4_matmul.MODE_K, "Q4_0": int4_matmul.MODE_H,
           "Q4_1": int4_matmul.MODE_H}


def read_back(packed: torch.Tensor, n: int, k: int) -> tuple[list[int], torch.Tensor, tuple]:
    """The packed layout read back in Python: (header, q, factors), features rounded up to whole
    blocks of 16; the factors as packed: (scale, low) float32 (F) or float16 (H), (d, sc, dmin, m)
    (K)."""
    header = packed[:64].view(torch.int64)[:4].tolist()
    mode, blocks, groups = header[1], -(-n // 16), k // 32
    body = packed[64:]

    def by_feature(t: torch.Tensor) -> torch.Tensor:  # [blocks, spans, (8,) 16] -> [features, -1]
        return t.movedim(-1, 1).reshape(blocks * 16, -1)

    if mode == int4_matmul.MODE_K:
        supers = body.reshape(blocks, k // 256, 2432)
        nibbles = supers[..., 384:].reshape(blocks, groups, 256)
        wide = supers[..., :128].contiguous().view(torch.float32).reshape(blocks, -1, 2, 16)
        small = supers[..., 128:384].reshape(blocks, -1, 2, 8, 16)
        factors = tuple(by_feature(t) for t in (wide[:, :, 0], small[:, :, 0], wide[:, :, 1],
                                                small[:, :, 1]))
    else:
        dtype = torch.float32 if mode == int4_matmul.MODE_F else torch.float16
        spans = body.reshape(blocks, groups, -1)
        nibbles = spans[..., :256]
        held = spans[..., 256:].contiguous().view(dtype).reshape(blocks, groups, 2, 16)
        factors = by_feature(held[:, :, 0]), by_feature(held[:, :, 1])
    # byte [i][f][e]: input 2i + e of feature f (low half), 16 + 2i + e (high half)
    pairs = nibbles.reshape(blocks, groups, 8, 16, 2).permute(0, 3, 1, 2, 4)
    low, high = (part.reshape(blocks, 16, groups, 16) for part in (pairs & 15, pairs >> 4))
    return header, torch.cat([low, high], dim=-1).reshape(blocks * 16, k), factors


@pytest.mark.parametrize("mode", MODES)
def test_pack_keeps_every_value_in_its_mode_s_bytes(mode, int4_build):
    """Each pack holds q and the factors as given (features past n zeros, with zero factors) after
    a 64-byte header of magic, mode, k and n: 6 bits a weight for F, 4.75 for K, 5 for H."""
    torch.manual_seed(6)
    n, k = 40, 512
    if mode == "F":
        factors = int4_matmul.quantize(torch.randn(n, k))
        packed, restored = int4_matmul.pack(*factors), int4_matmul.restore(*factors)
    elif mode == "K":
        factors = compact_factors(mode, n, k)
        packed, restored = int4_matmul.pack_k(*factors), int4_matmul.restore_k(*factors)
    else:
        factors = compact_factors(mode, n, k)
        packed, restored = int4_matmul.pack_half(*factors), int4_matmul.restore_half(*factors)
    header, q, held = read_back(packed, n, k)
    assert header == [MAGIC, MODE_OF[mode], k, n] and int4_matmul.packed_mode(packed) == header[1]
    assert (len(packed) - 64) * 8 / (48 * k) == {"F": 6, "K": 4.75}.get(mode, 5)
    assert torch.equal(q[:n], factors[0]) and not q[n:].any()
    for given, read in zip(factors[1:], held, strict=True):
        assert read.dtype == given.dtype and torch.equal(read[:n], given)
        assert not read[n:].bool().any()
    restore = {"F": int4_matmul.restore, "K": int4_matmul.restore_k}.get(
        mode, int4_matmul.restore_half)
    assert torch.equal(restore(q[:n], *(t[:n] for t in held)), restored)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q4_1"])
def test_gguf_blocks_in_their_own_factors_are_its_dequantization(kind, int4_build):
    """Random GGUF blocks (every bit pattern, finite float16 factors) as mode K's or H's factors:
    their restore is the `gguf` package's dequantization bit for bit, and past the tiles' rows
    the kernel multiplies by its bf16 (an identity's rows read it back)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(7)
    rows, columns = 48, 512
    data = rng.integers(0, 256, (rows, ggml_quants.row_bytes(kind, columns)), dtype=np.uint8)
    blocks = data.reshape(-1, ggml_quants.BLOCK_TYPES[kind].block_bytes)
    for at in [0] if kind == "Q4_0" else [0, 2]:
        factors = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = factors.view(np.uint8).reshape(-1, 2)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(
        data, gguf.GGMLQuantizationType[kind]), dtype=np.float32)).reshape(rows, columns)
    b = torch.from_numpy(blocks)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, -1)

    if kind == "Q4_K":
        sc, m = ggml_quants.scale_min(b[:, 4:16])
        q = ggml_quants._nibbles(b[:, 16:144], 32)
        factors = [per_row(t) for t in (q, ggml_quants.half(b, 0), sc, ggml_quants.half(b, 2), m)]
        packed, restored = int4_matmul.pack_k(*factors), int4_matmul.restore_k(*factors)
    else:
        scale = b[:, 0:2].contiguous().view(torch.float16)
        low = (-8 * scale.float()).half() if kind == "Q4_0" else b[:, 2:4].contiguous().view(
            torch.float16)
        q = ggml_quants._nibbles(b[:, 2:18] if kind == "Q4_0" else b[:, 4:20], 16)
        factors = [per_row(t) for t in (q, scale, low)]
        packed, restored = int4_matmul.pack_half(*factors), int4_matmul.restore_half(*factors)
    assert torch.equal(restored, expected)
    if int4_matmul.tile_rows() is not None:
        eyes = torch.eye(columns, dtype=torch.bfloat16)
        assert torch.equal(int4_matmul.matmul(eyes, packed, rows, None), expected.bfloat16().T)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_of_another_shape_or_no_header_is_refused(mode, int4_build):
    """The kernel takes the mode, k and n from the header: a call with another k or n, or a buffer
    whose magic or mode is not ours, is refused (-1: a ValueError), in the 4-bit tiles and the
    unpacked blocks alike."""
    torch.manual_seed(8)
    packed, _, k = packed_weight(mode, 32, 256)
    for rows in (2, 40):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        assert int4_matmul.matmul(x, packed, 32, None).shape == (rows, 32)
        with pytest.raises(ValueError):
            int4_matmul.matmul(x, packed, 16, None)
        with pytest.raises(ValueError):
            int4_matmul.matmul(torch.randn(rows, 2 * k, dtype=torch.bfloat16), packed, 32, None)
        for word, value in ((0, 0), (1, 3), (1, -1)):  # the magic, modes of no one
            broken = packed.clone()
            broken[:64].view(torch.int64)[word] = value
            with pytest.raises(ValueError):
                int4_matmul.matmul(x, broken, 32, None)


def test_factors_a_mode_does_not_hold_are_a_value_error(int4_build):
    """K takes whole superblocks of 256 inputs and 6-bit sc and m; H float16 factors; every mode
    q in 0..15 and factors of its groups' shape."""
    q, d, sc, dmin, m = compact_factors("K", 16, 256)
    with pytest.raises(ValueError):
        int4_matmul.pack_k(q[:, :224], d, sc[:, :7], dmin, m[:, :7])
    with pytest.raises(ValueError):
        int4_matmul.pack_k(q, d, sc.clone().fill_(64), dmin, m)
    with pytest.raises(ValueError):
        int4_matmul.pack_k(q, d, sc, dmin[:, :0], m)
    q, scale, low = compact_factors("Q4_1", 16, 64)
    with pytest.raises(ValueError):
        int4_matmul.pack_half(q, scale.float(), low.float())
    with pytest.raises(ValueError):
        int4_matmul.pack_half(q + 1, scale, low)
    with pytest.raises(ValueError):
        int4_matmul.pack(q[:, :48], scale.float(), low.float())
