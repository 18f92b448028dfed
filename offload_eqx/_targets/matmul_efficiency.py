"""The fraction of a chip's peak one matrix multiplication reaches, from its shape: the
table `ox.Speeds.matmul_efficiency` holds, read by both of `ox.estimate`'s pricers.

A GPU library computes `C = A B` (`A`: M x K, `B`: K x N) as output tiles, one thread
block per tile, the blocks spread over the streaming multiprocessors (SMs) in waves.
NVIDIA's "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023) names the
two ways a shape loses throughput to that:

- *tile quantization* (its section 3.1): M and N are cut into whole tiles, so a tile on
  the edge computes padding;
- *wave quantization* (its section 3.2): the tiles run in waves of one per SM, so a last,
  partial wave leaves SMs idle.

The model prices exactly those: a GEMM reaches `large` (the fraction of peak of one whose
tiles fill whole waves) times its *fill*, the useful share of the tile-slots it occupies,

    tiles = batch x ceil(M / tile_m) x ceil(N / tile_n)
    fill  = batch x M x N / (tile_m x tile_n) / (ceil(tiles / units) x units)

times the rate of its input type relative to the bf16 peak (`dtype_rates`). K enters
through the roofline both pricers already take (`max(FLOPs / rate, bytes / HBM
bandwidth)`): a GEMM with a short K moves many bytes per FLOP.

What it leaves out: a library that picks a smaller tile, or splits K, when the large
tile would leave SMs idle (a narrow layer's weight gradient, with few output tiles and
a long K) runs faster than priced here; the model is the large tile's, the most
efficient one (the guide's section 2.3), so it errs on the slow side for small GEMMs.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

# HLO's names of the element types, as NumPy (and a jaxpr) names them.
_HLO_DTYPES = {
    "bf16": "bfloat16",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
    "s8": "int8",
    "u8": "uint8",
    "s32": "int32",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
}

_FRACTION = (
    "ox.MatmulEfficiency({field}={value!r}): expected a fraction of the peak in (0, 1] "
    "(what a large GEMM reaches, as measured or published for the chip)."
)
_WHOLE = (
    "ox.MatmulEfficiency({field}={value!r}): expected {what}, e.g. {example}; it counts {meaning}."
)
_RATES = (
    "ox.MatmulEfficiency(dtype_rates={value!r}): expected (dtype name, rate) pairs, the "
    "rate a number in (0, 1] (the type's peak over the bf16 peak `ox.Speeds.flops`), "
    "e.g. (('float32', 0.5),) for TF32 on an H100."
)


def canonical_dtype(dtype: object) -> str:
    """A dtype's NumPy name (`"bfloat16"`), from a NumPy/JAX dtype or HLO's `"bf16"`."""
    if isinstance(dtype, str):
        return _HLO_DTYPES.get(dtype, dtype)
    try:
        return np.dtype(dtype).name  # type: ignore[arg-type]
    except TypeError:
        return str(getattr(dtype, "name", dtype))


def _positive_whole(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value > 0)


def _fraction(value: object) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and bool(np.isfinite(value))
        and bool(0 < value <= 1)
    )


@dataclasses.dataclass(frozen=True)
class MatmulEfficiency:
    """How the fraction of peak a GEMM reaches depends on its shape: tile and wave
    quantization (NVIDIA's Matrix Multiplication Background User's Guide, sections 3.1
    and 3.2). An (M x K) by (K x N) product, `batch` of them, of `dtype` inputs reaches

        large x fill x rate(dtype),  where
        tiles = batch x ceil(M / tile[0]) x ceil(N / tile[1])
        fill  = batch x M x N / (tile[0] x tile[1]) / (ceil(tiles / units) x units)

    (K enters through the roofline: `max(FLOPs / rate, bytes / HBM bandwidth)`).

    - `large`: the fraction of `ox.Speeds.flops` a large GEMM whose tiles fill whole
        waves reaches.
    - `tile`: `(rows, columns)` of the output one thread block computes.
    - `units`: the SMs (or cores) the tiles are spread over, one at a time each.
    - `dtype_rates`: `(dtype name, rate)` pairs: an input type's peak over the bf16
        peak (`"float32"`: TF32 on a GPU). A type not named runs at 1.
    - `source`: where the figures come from, one line.
    """

    large: float
    tile: tuple[int, int]
    units: int
    dtype_rates: tuple[tuple[str, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not _fraction(self.large):
            raise ValueError(_FRACTION.format(field="large", value=self.large))
        if not (
            isinstance(self.tile, tuple)
            and len(self.tile) == 2
            and all(_positive_whole(t) for t in self.tile)
        ):
            raise ValueError(
                _WHOLE.format(
                    field="tile",
                    value=self.tile,
                    what="a tuple of two whole numbers > 0",
                    example="(128, 256)",
                    meaning="the output rows and columns one thread block computes",
                )
            )
        if not _positive_whole(self.units):
            raise ValueError(
                _WHOLE.format(
                    field="units",
                    value=self.units,
                    what="a whole number > 0",
                    example="132 for an H100 SXM5",
                    meaning="the SMs that run one tile each at a time",
                )
            )
        rates = self.dtype_rates
        if not (
            isinstance(rates, tuple)
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and _fraction(pair[1])
                for pair in rates
            )
        ):
            raise ValueError(_RATES.format(value=rates))

    def fill(self, m: int, n: int, batch: int = 1) -> float:
        """The useful share of the tile-slots an `m` x `n` output (`batch` of them)
        occupies: tile quantization times wave quantization."""
        rows, columns = self.tile
        tiles = batch * math.ceil(m / rows) * math.ceil(n / columns)
        slots = math.ceil(tiles / self.units) * self.units
        return batch * m * n / (rows * columns) / slots

    def rate(self, dtype: object) -> float:
        """The input type's peak over the bf16 peak (1 for a type not named)."""
        return dict(self.dtype_rates).get(canonical_dtype(dtype), 1.0)

    def __call__(self, m: int, n: int, k: int, dtype: object, batch: int = 1) -> float:
        """The fraction of the bf16 peak an (`m` x `k`) by (`k` x `n`) product of
        `dtype` inputs reaches (`batch` of them at once)."""
        return self.large * self.fill(m, n, batch) * self.rate(dtype)


def dot_shape(
    lhs: Sequence[int],
    rhs: Sequence[int],
    lhs_contracting: Sequence[int],
    rhs_contracting: Sequence[int],
    lhs_batch: Sequence[int] = (),
    rhs_batch: Sequence[int] = (),
) -> tuple[int, int, int, int]:
    """`(m, n, k, batch)` of a dot from its operands' dimensions and its dimension
    numbers (a jaxpr's `dot_general` and HLO's `dot` alike): the free dimensions of
    each side multiply into M and N, the contracted ones into K, the batch ones into
    the batch."""
    m = math.prod(d for i, d in enumerate(lhs) if i not in (*lhs_contracting, *lhs_batch))
    n = math.prod(d for i, d in enumerate(rhs) if i not in (*rhs_contracting, *rhs_batch))
    k = math.prod(lhs[i] for i in lhs_contracting if i < len(lhs))
    batch = math.prod(lhs[i] for i in lhs_batch if i < len(lhs))
    return int(m), int(n), int(k), int(batch)


# NVIDIA H100 SXM5 (and the H100 of a GH200, the same GPU):
# - `units`: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper, the SXM5
#   configuration).
# - `tile`: 128 x 256, the guide's most efficient cuBLAS tile (section 2.3: 256x128 and
#   128x256 the most efficient, 64x64 the least); cuBLASLt lists it as
#   `CUBLASLT_MATMUL_TILE_128x256`.
# - `large`: 0.73, our own measurement: on a lent H100 80GB HBM3 the optimizer step of
#   `benchmarks/gpu_check.py` (4 matmuls of 12288 x 12288 x 12288 in bf16) ran its matmuls
#   at about 73% of the 989 TFLOP/s peak (benchmarks/README.md, "Predicted against
#   measured"). That shape fills 4608 of its 35 waves' 4620 tile-slots (0.997), so the
#   measured fraction is `large` itself. No published figure of cuBLAS's fraction of an
#   H100's peak by shape, in numbers, was found where we searched (NVIDIA's "New cuBLAS
#   12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs" post and
#   the guide above); `benchmarks/gpu_check.py --parts matmuls` measures the shapes of
#   `MATMUL_SHAPES` to check the table on the next lent GPU.
# - `dtype_rates`: float32 is multiplied in TF32 by default (XLA:GPU), whose peak is half
#   of bf16's (H100 SXM datasheet: TF32 989 TFLOP/s with sparsity, BF16 1,979 with
#   sparsity, each dense rate half of that); float64 on the FP64 tensor cores at 67
#   TFLOP/s.
H100_MATMUL = MatmulEfficiency(
    large=0.73,
    tile=(128, 256),
    units=132,
    dtype_rates=(("float32", 0.5), ("float64", 67 / 989)),
    source=(
        "tile and wave quantization (NVIDIA Matrix Multiplication Background User's Guide) "
        "over 132 SMs with 128x256 tiles; 0.73 of peak measured for 12288^3 bf16 on an H100"
    ),
)

# Shapes whose predicted efficiency `benchmarks/gpu_check.py` prints beside the measured
# one (M, N, K), bf16: square sizes across the range, and LLM-like rectangles (a 13B
# model's 5120-wide projections over 8192 tokens, and a narrow layer's weight gradient).
MATMUL_SHAPES = (
    (256, 256, 256),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (12288, 12288, 12288),
    (8192, 5120, 5120),
    (8192, 13824, 5120),
    (1024, 1024, 65536),
)
