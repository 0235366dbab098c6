"""The byte-level BPE tokenizer the offline tiny checkpoints share (galaxy.models.tiny_llama,
galaxy.models.tiny_gpt2), trained with the `tokenizers` package on Python's own documentation
(pydoc_data.topics), so that no hub download is ever needed."""
from __future__ import annotations


def train_bpe(vocab_size: int, special_tokens: list[str]):
    """A tokenizers.Tokenizer: byte-level pre-tokenizer and decoder (no prefix space), BPE merges
    learnt from pydoc_data.topics; the special tokens take ids 0, 1, ... in the order given."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [t for t in pydoc_data.topics.topics.values()]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
