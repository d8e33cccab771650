"""Import the real SGLang 0.5.23 on a CPU machine, and a tiny model directory it resolves.

SGLang's Python code runs on CPU torch, with one blocker: `import sglang` reaches torchvision
through transformers, and the index's torchvision is a CUDA build whose C++ ops cannot register
on CPU torch. Defining the two `torchvision` operator schemas it needs before anything imports
torchvision lets every scheduler, model-runner, layer and HTTP module import. SGLang's CUDA
kernels stay out of reach; the tests call SGLang's torch paths.
"""

from __future__ import annotations

import importlib
import json
import os

# One implementation, in the package: make_checkpoint --layout hf and the serving loader install
# it too (the README's CPU install has the same torchvision).
from sglang_dsv41.torchvision_shim import install_torchvision_shim  # noqa: F401

SGLANG_VERSION = "0.5.23"


def import_sglang(module: str):
    """Import `module` from the installed SGLang 0.5.23 (the README's test install has it)."""
    install_torchvision_shim()
    version = importlib.import_module("sglang.version").__version__
    if version != SGLANG_VERSION:
        raise RuntimeError(f"tests need sglang=={SGLANG_VERSION}, found {version}")
    return importlib.import_module(module)


WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "again", "sticky", "turn"]


def write_tiny_model(model_dir: str) -> str:
    """A model directory SGLang resolves on CPU (``--device cpu``): the tiny-v4 preset's config,
    read as DeepSeek V4 by SGLang's ModelConfig, and a WordLevel tokenizer over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sglang_dsv41.model.dsv4.presets import get_preset
    from sglang_dsv41.tools.make_checkpoint import release_config

    os.makedirs(model_dir, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(model_dir)
    config = release_config(get_preset("tiny-v4"), [32, 32], "fp8")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return model_dir
