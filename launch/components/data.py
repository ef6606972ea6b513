"""Data: a real English corpus that every CPython ships offline, ``pydoc_data.topics`` (the text
of the ``help()`` topics, ~470 KB), a tokenizer (``bpe``: a byte-level BPE of ``data.vocab_size``
trained on that corpus with the ``tokenizers`` package; ``byte``: raw UTF-8 bytes, 256 ids) and
``SequenceData``, fixed-length sequences visited in a per-epoch permutation drawn from the seed:
the data position (sequences consumed) alone determines every later batch. Tokenizer and token
ids are cached under ``data.cache_dir``."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from .config import DataConfig

log = logging.getLogger("flce_dist.train")

CORPUS_NAME = "pydoc_data.topics"
EOT = "<|endoftext|>"


def corpus_documents() -> list[str]:
    """The ``help()`` topic texts CPython ships in ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def build_tokens(cfg: DataConfig) -> tuple[torch.Tensor, int]:
    """Token ids of the whole corpus (documents joined by an end-of-text token) and the vocab size.
    Cached under ``cache_dir``; concurrent builders write identical files atomically."""
    docs = corpus_documents()
    digest = hashlib.sha1("\0".join(docs).encode()).hexdigest()[:10]
    kind, target = cfg.tokenizer, int(cfg.vocab_size)
    cache = Path(cfg.cache_dir)
    tag = f"{kind}-{target}-{digest}" if kind == "bpe" else f"byte-{digest}"
    tok_file = cache / f"tokens-{tag}.pt"
    if tok_file.is_file():
        blob = torch.load(tok_file, weights_only=True)
        return blob["ids"].long(), int(blob["vocab_size"])
    t0 = time.perf_counter()
    if kind == "byte":
        eot = 0  # NUL never occurs in the text: it separates documents
        ids: list[int] = []
        for d in docs:
            ids.extend(d.encode("utf-8"))
            ids.append(eot)
        vocab = 256
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=2, special_tokens=[EOT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(docs, trainer=trainer)
        atomic_write(cache / f"tokenizer-{tag}.json", lambda p: tok.save(str(p)))
        eot = tok.token_to_id(EOT)
        ids = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eot)
        vocab = tok.get_vocab_size()
    t = torch.tensor(ids, dtype=torch.int32)
    atomic_write(tok_file, lambda p: torch.save({"ids": t, "vocab_size": vocab}, p))
    log.info("tokenised %s with %s (vocab %d): %d tokens in %.1f s, cached in %s",
             CORPUS_NAME, kind, vocab, t.numel(), time.perf_counter() - t0, tok_file)
    return t.long(), vocab


class SequenceData:
    """Fixed-length sequences of the token stream in a seeded per-epoch order.

    ``batch(position, b)`` returns sequences ``position .. position + b - 1`` of the infinite
    stream epoch 0 permutation, epoch 1 permutation, ...: the position is the whole data state.
    ``batch(position, b, dp_rank, dp)`` is dp rank ``dp_rank``'s rows ``[d*b/dp, (d+1)*b/dp)`` of
    that global batch."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int) -> None:
        n = ids.numel() // seq_len
        if n < 1:
            raise ValueError(f"corpus of {ids.numel()} tokens is shorter than seq_len={seq_len}")
        self.seqs = ids[: n * seq_len].view(n, seq_len)
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.seqs.shape[0]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self), generator=g)}
        return self._perms[epoch]

    def batch(self, position: int, batch_size: int, dp_rank: int = 0, dp: int = 1) -> torch.Tensor:
        if batch_size % dp:
            raise ValueError(f"batch_size={batch_size} is not divisible by dp={dp}")
        local = batch_size // dp
        rows = []
        for k in range(position + dp_rank * local, position + (dp_rank + 1) * local):
            epoch, j = divmod(k, len(self))
            rows.append(int(self._perm(epoch)[j]))
        return self.seqs[rows]
