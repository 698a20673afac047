"""Integrations of diffkv into other frameworks (vLLM-Omni: a later issue)."""
