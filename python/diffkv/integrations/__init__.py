"""Integrations of diffkv into other frameworks: vllm_omni (install() makes vLLM-Omni run diffkv)."""
