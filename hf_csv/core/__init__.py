"""The engine-agnostic certificate: the screen's bounds, the certified head and its checks, the speed guard.

Imports torch, FAISS and :mod:`hf_csv_kernels` only: never transformers, vLLM or the Hub layer
(``tests/test_layout.py`` checks it)."""
