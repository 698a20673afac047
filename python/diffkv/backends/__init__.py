"""Attention backends: vLLM-Omni's diffusion backend ABC (abstract.py) and DIFFKV (diffkv.py).

Which backend serves a layer is decided in ``diffkv.selector``."""
