"""Helpers for testing kvcompose and pipelines against a real vLLM engine on CPU.

Not imported by the connector; needs the ``test`` extra (transformers, tokenizers).
"""
