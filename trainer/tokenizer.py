"""The project's own character-level tokenizer, built in code so nothing is downloaded.

One token per character (digits, ASCII letters, punctuation, space, newline) plus <pad>, <bos>,
<eos>, <unk>: about 100 ids, so tiny random-init models stay tiny and every built-in task's
answer is a handful of tokens. Encoding prepends <bos>; padding is on the left (decoder-only
generation continues from the last prompt token). Exercised by `pytest tests/test_models.py -k tokenizer`.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the character-level tokenizer (ids 0-3 are <pad>, <bos>, <eos>, <unk>)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token (`[\s\S]` so newlines are characters too).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse: decode by concatenation; the default decoder would put spaces between characters.
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        truncation_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    return tok
