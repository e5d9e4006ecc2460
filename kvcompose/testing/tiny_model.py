"""A tiny random-weight Llama with a word-level tokenizer, built locally.

No model hub is reachable from CI, so tests and the demo generate this model
once into a cache directory. ``initializer_range=0.2`` makes greedy output
depend on the prompt, so a corrupted KV load changes the generated tokens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

VOCAB_SIZE = 512
MODEL_VERSION = "v1"


def default_cache_dir() -> Path:
    root = os.environ.get("KVCOMPOSE_CACHE", str(Path.home() / ".cache" / "kvcompose"))
    return Path(root) / f"tiny-llama-{MODEL_VERSION}"


def ensure_tiny_model(directory: Path | None = None) -> Path:
    """Return a directory holding the tiny model, generating it if absent."""
    target = directory or default_cache_dir()
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        _write_model(staging)
        _write_tokenizer(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def prompt_words(seed: int, length: int) -> str:
    """A deterministic prompt of ``length`` vocabulary words."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, VOCAB_SIZE)}" for _ in range(length))


def _write_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the CPU attention kernel rejects 16
        num_key_value_heads=1,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="w1", eos_token="w2"
    )
    wrapped.save_pretrained(directory)
