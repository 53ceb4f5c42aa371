"""GGUF quantisation types: block geometry, torch dequantisation, numpy quantisation."""

from .dequant import dequantize
from .quantize import QUANTIZABLE_TYPES, fallback_type, quantize
from .tensor import QuantizedTensor
from .types import (
    FP4_VALUES,
    FP16_FIELDS,
    IQ4_VALUES,
    QK_K,
    SUPPORTED_TYPES,
    QuantType,
    as_quant_type,
    check_row_length,
    row_nbytes,
    tensor_nbytes,
)

__all__ = [
    "FP4_VALUES",
    "FP16_FIELDS",
    "IQ4_VALUES",
    "QK_K",
    "QUANTIZABLE_TYPES",
    "SUPPORTED_TYPES",
    "QuantType",
    "QuantizedTensor",
    "as_quant_type",
    "check_row_length",
    "dequantize",
    "fallback_type",
    "quantize",
    "row_nbytes",
    "tensor_nbytes",
]
