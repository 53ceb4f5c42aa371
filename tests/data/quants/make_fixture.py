"""Regenerate llamacpp_quants.npz: llama.cpp's own quantizer output, the oracle for moerun's encoders.

The fixture was generated with llama-cpp-python 0.3.16 (vendored ggml commit 4227c9b, built with
CMAKE_ARGS="-DGGML_NATIVE=OFF"); the versions actually used are stored in the file under
`ggml_version`, `ggml_commit` and `llama_cpp_python_version`. Its legacy and K-quant entries are
byte for byte those an earlier generation with llama-cpp-python 0.3.36 (commit 0c1e570) wrote.

It calls `ggml_quantize_chunk` from libggml-base through ctypes without an importance matrix,
i.e. the `quantize_row_*_ref` algorithms. Needs llama-cpp-python (slow to build, so CI only
reads the committed .npz):

    pip install llama-cpp-python
    python tests/data/quants/make_fixture.py [--lib /path/to/libggml-base.so]

Importing this module is cheap; the tests reuse `weight_matrix` to rebuild the larger matrix.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
from pathlib import Path

import numpy as np

OUT = Path(__file__).with_name("llamacpp_quants.npz")
ROW_LEN = 512
MATRIX_SEED = 20240601
MATRIX_SHAPE = (128, 2048)

# GGML type ids of everything the fixture covers (legacy 32-element types, K-quants, IQ4_NL / IQ4_XS, ternary and
# MXFP4).
TYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39, "IQ3_XXS": 18, "IQ3_S": 21,
}


def awkward_rows(seed: int = 7, row_len: int = ROW_LEN) -> np.ndarray:
    """Rows [16, row_len] that hit the edge cases of the scale searches (zero, constant, outliers...)."""
    rng = np.random.default_rng(seed)

    def g() -> np.ndarray:
        return rng.standard_normal(row_len).astype(np.float32)

    rows = [np.zeros(row_len, np.float32), np.full(row_len, 0.37, np.float32), np.full(row_len, -1.25, np.float32)]
    r = g()
    r[::97] *= 1000  # huge outliers
    rows.append(r)
    rows.append(-np.abs(g()))  # negative only
    rows.append(np.abs(g()) + 2)  # positive only, far from zero
    r = g()
    r[:16] = 0  # all-zero and constant sub-blocks next to normal ones
    r[32:64] = 0
    r[256:272] = 5e-3
    rows.append(r)
    rows.append(g() * 1e-6)  # tiny
    rows.append(g() * 1e-20)  # below the fp16 range
    rows.append(g() * 3e4)  # scales beyond the fp16 range
    r = np.zeros(row_len, np.float32)
    r[5], r[300] = 1.0, -2.0  # isolated spikes
    rows.append(r)
    rows.append(np.round(g() * 3))  # small integers: exact ties in the rounding
    rows.append(rng.uniform(-1, 1, row_len).astype(np.float32))
    rows.append(g() ** 3)  # heavy tailed
    r = g()
    r[128:] = np.abs(r[128:])
    rows.append(r)
    rows.append(np.linspace(-1, 3, row_len, dtype=np.float32))
    return np.stack(rows).astype(np.float32)


def weight_matrix(seed: int = MATRIX_SEED, shape: tuple[int, int] = MATRIX_SHAPE) -> np.ndarray:
    """A weight-like matrix: Gaussian rows with log-normal scales and a few outlier input columns."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= np.exp(rng.normal(-4.0, 0.5, (shape[0], 1))).astype(np.float32)
    cols = rng.choice(shape[1], 8, replace=False)
    w[:, cols] *= np.float32(10)
    return w


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


class Ggml:
    """ctypes access to ggml_quantize_chunk and ggml's dequantizers."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        # (type, src, dst, start, nrows, n_per_row, imatrix)
        self.lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]
        self.lib.ggml_row_size.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lib.ggml_version.restype = ctypes.c_char_p
        self.lib.ggml_commit.restype = ctypes.c_char_p

    def quantize(self, x: np.ndarray, type_id: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        row_bytes = self.lib.ggml_row_size(type_id, x.shape[1])
        out = np.zeros((x.shape[0], row_bytes), np.uint8)
        written = self.lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        assert written == out.size, (written, out.size)
        return out


def default_lib() -> Path:
    import llama_cpp  # noqa: PLC0415 - only the generator needs it

    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not libs:
        raise FileNotFoundError(f"no libggml-base in {Path(llama_cpp.__file__).parent / 'lib'}")
    return libs[0]


def main() -> None:
    import gguf  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", type=Path, default=None, help="libggml-base shared library (default: llama_cpp's)")
    args = parser.parse_args()
    ggml = Ggml(args.lib or default_lib())
    try:
        import llama_cpp  # noqa: PLC0415

        lcp_version = llama_cpp.__version__
    except ImportError:
        lcp_version = "unknown"

    rows = awkward_rows()
    mat = weight_matrix()
    data: dict[str, np.ndarray] = {
        "rows": rows,
        "matrix_seed": np.int64(MATRIX_SEED),
        "matrix_shape": np.array(MATRIX_SHAPE),
        "matrix_sha256": np.array(sha256(mat)),
        "ggml_version": np.array(ggml.lib.ggml_version().decode()),
        "ggml_commit": np.array(ggml.lib.ggml_commit().decode()),
        "llama_cpp_python_version": np.array(lcp_version),
    }
    for name, type_id in TYPES.items():
        data[f"rows_{name}"] = ggml.quantize(rows, type_id)
        q = ggml.quantize(mat, type_id)
        # Decode with gguf (bit-exact with ggml's decoders) to score llama.cpp's own error.
        deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType(type_id))
        data[f"matrix_sha256_{name}"] = np.array(sha256(q))
        data[f"matrix_rmse_{name}"] = np.float64(np.sqrt(np.mean((deq.astype(np.float64) - mat) ** 2)))
        print(f"{name}: rmse {float(data[f'matrix_rmse_{name}']):.6g}")
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
