"""A small byte-level BPE tokenizer for the local test models, trained at build time (no download).

The corpus is made-up text from a seeded generator, so the tokenizer is the same on every machine
and every run: byte-level BPE (any text encodes), trained with the ``tokenizers`` library up to the
model's vocabulary size; ids the corpus cannot fill are padded with unused special tokens, so every
id a model may generate decodes. ``<pad>``, ``<s>``, ``</s>`` are ids 0, 1, 2 (the models' BOS and
EOS). Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with a plain chat template), which
vLLM and transformers' ``AutoTokenizer`` load from the model directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>"]
SYLLABLES = ("ka to ri me sa lo ne pu di va mo ze fi ru ta shi en ar ol in us er an is ou th ch st "
             "pr gr").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def words(seed: int, n: int = 8000) -> list[str]:
    """``n`` made-up words of one to four syllables, the same for the same ``seed``."""
    rng = random.Random(seed)
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def sentences(seed: int, n: int) -> Iterator[str]:
    """``n`` made-up sentences (the training corpus, and text the demo can send)."""
    rng = random.Random(seed)
    vocab = words(seed)
    for _ in range(n):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 15)))
        yield text.capitalize() + rng.choice(".?!,")


def train(vocab_size: int, seed: int = 1234):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids (deterministic for a seed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sentences(seed, 20000), trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([AddedToken(f"<unused{i}>", special=True) for i in range(missing)])
    return tok


def save(out: Path, vocab_size: int, max_len: int, seed: int = 1234) -> None:
    """Write the tokenizer files into the model directory ``out``."""
    train(vocab_size, seed).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
              "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
