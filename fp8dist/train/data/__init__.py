"""Training data: the built-in grammar corpus (:class:`Batches` over :func:`make_corpus`'s sentences, byte ids, no
download) and real text files (:func:`load_text_corpus` tokenizes them through a token cache on disk;
:class:`TextBatches` packs the tokens into held-out and shuffled training windows, with a position to resume)."""

from .builtin import VOCAB_SIZE, Batches, check_batch_split, check_fits_corpus, make_corpus
from .cache import TokenFile, default_cache_dir
from .corpus import TokenCorpus, load_text_corpus
from .tokenizer import check_vocab_fits, load_tokenizer, train_tokenizer
from .windows import DEFAULT_EVAL_FRACTION, TextBatches

__all__ = ["VOCAB_SIZE", "make_corpus", "Batches", "check_batch_split", "check_fits_corpus", "load_text_corpus",
           "TokenCorpus", "TokenFile", "TextBatches", "DEFAULT_EVAL_FRACTION", "load_tokenizer", "check_vocab_fits",
           "train_tokenizer", "default_cache_dir"]
