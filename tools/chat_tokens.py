"""The built-in model's tokenizer conventions and the byte-level BPE trainer behind them.

``tools/train_default_model.py`` trains the shipped model's tokenizer with these, and the
tests' tiny checkpoints (tests/helpers/checkpoints.py) train theirs with the same tokens,
order and chat template, so both kinds of checkpoint exercise the engine identically.
Offline tooling: the engine itself never trains a tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
END_TOKEN = "<|end|>"
# Ids 0.. in this order: EOS first.
SPECIAL_TOKENS = [EOS_TOKEN, END_TOKEN, "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style, no prefix space) with ``SPECIAL_TOKENS``, trained on
    ``texts``: every byte has a token, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
