"""Build a tiny random-weight Llama that a real vLLM can serve on a CPU, offline, in seconds.

    .venv-vllm/bin/python scripts/tiny_llama.py DIRECTORY

Run it with the Python that has vLLM (`make vllm-env` makes `.venv-vllm`): it needs torch,
transformers and tokenizers, which the exporter does not. Nothing is downloaded. The model is
a `LlamaForCausalLM` with hidden size 256 and 2 layers (about 1.3 M parameters, a few MB) and a
byte-level BPE tokenizer trained here on a fixed made-up corpus, so any text tokenizes. The
weights are random (fixed seed): it generates gibberish, at thousands of tokens per second on
two cores, which is all a test of memory and metrics needs.

The same script gives the same files, byte for byte, on every run (checked by the real_vllm
tests), so a server's start-up log and page do not depend on when the model was built.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
VOCAB = 1024
MAX_POSITIONS = 2048  # what the model allows: vLLM refuses a larger --max-model-len
SEED = 0

# The tokenizer's corpus: made-up sentences over a fixed word list, so training needs no data.
_WORDS = """\
the a memory cache block token request server engine worker model layer weight tensor
gpu cpu host page size free used total bytes leak queue wait run batch prefix decode prompt output
time second minute fast slow full empty grow shrink hold keep drop move copy read write send take
give start stop load save check alert page warn error fail pass one two three four five six seven
eight nine ten hundred thousand million kilo mega giga and or not if then else when while for with
from into onto over under above below before after is are was were be been has have had do does did
"""


def corpus(lines: int = 2000) -> list[str]:
    rng = random.Random(SEED)
    vocabulary = _WORDS.split()
    text = []
    for _ in range(lines):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(4, 16))]
        number = str(rng.randint(0, 10 ** rng.randint(1, 9)))
        words.insert(rng.randrange(len(words)), number)
        text.append(" ".join(words).capitalize() + rng.choice(".?!,;:"))
    return text


def build_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer with <s>, </s> and <unk>, saved as a fast tokenizer.
    Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=MAX_POSITIONS)
    # A chat template, so /v1/chat/completions works as well as /v1/completions.
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(str(directory))
    return tokenizer.get_vocab_size()


def build_model(directory: Path, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=vocab_size,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(str(directory), safe_serialization=True)


def digest(directory: Path) -> str:
    """One hash over every file's name and bytes: equal digests, equal models."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def build(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    vocab = build_tokenizer(directory)
    build_model(directory, vocab)
    return digest(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the model (created if missing)")
    args = parser.parse_args(argv)
    print(json.dumps({"directory": str(args.directory), "sha256": build(args.directory)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
