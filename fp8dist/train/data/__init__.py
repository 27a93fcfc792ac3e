"""Training data: the built-in grammar corpus (byte tokens, no download) and real text files.

Built-in: :class:`Batches` over :func:`make_corpus`'s sentences, ids are bytes (:data:`VOCAB_SIZE`).

Real text: :func:`load_text_corpus` tokenizes plain-text and JSON-lines files with a fast tokenizer saved by
``save_pretrained`` (local files only), through a token cache on disk (:mod:`fp8dist.train.data.cache`);
:class:`TextBatches` packs the tokens into ``seq_len + 1`` windows, holds some out for validation, shuffles the rest
from the seed, gives each rank its slice of every global batch and saves/restores its position for exact resumes.
"""

from .builtin import VOCAB_SIZE, Batches, check_batch_split, check_fits_corpus, make_corpus
from .cache import TokenFile, default_cache_dir
from .corpus import TokenCorpus, load_text_corpus
from .tokenizer import check_vocab_fits, load_tokenizer, train_tokenizer
from .windows import DEFAULT_EVAL_FRACTION, TextBatches

__all__ = ["VOCAB_SIZE", "make_corpus", "Batches", "check_batch_split", "check_fits_corpus", "load_text_corpus",
           "TokenCorpus", "TokenFile", "TextBatches", "DEFAULT_EVAL_FRACTION", "load_tokenizer", "check_vocab_fits",
           "train_tokenizer", "default_cache_dir"]
