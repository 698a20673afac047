"""Attention backends: the seed's diffusion backend ABC (abstract.py) and DIFFKV (diffkv.py)."""
