"""Raw kernels for hf_csv: plain torch references, a fast CPU path and Triton GPU kernels.

This package imports neither ``hf_csv`` nor ``transformers``. Every op has a torch
reference with the same signature; :mod:`hf_csv_kernels.dispatch` picks the
implementation by device in one place (``HF_CSV_KERNELS=reference`` forces the
references).
"""
from .quantize import Int8Rows, QuantRows, quantize_rows_fp8, quantize_rows_int8, unit_roundoff, gamma
from .dispatch import backend_for, get_op

__all__ = ["Int8Rows", "QuantRows", "quantize_rows_int8", "quantize_rows_fp8", "unit_roundoff", "gamma", "backend_for", "get_op"]
