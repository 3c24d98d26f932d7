"""A character-level corpus from any UTF-8 text file, for language models, and its windows as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpar.datasets.arrays import LANGUAGE_MODEL, TrainData
from fedpar.datasets.catalog import register_dataset

if TYPE_CHECKING:  # imported by text_windows: the registry reads this module's entry without torch
    import torch


@dataclass
class CharCorpus:
    """Vocabulary (sorted characters), train/val token arrays (int64) and the context length."""

    chars: list[str]
    train: np.ndarray
    val: np.ndarray
    block_size: int
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Build the character -> id lookup."""
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of ``text``; raises ValueError naming a character outside the vocabulary."""
        try:
            return np.fromiter((self._index[c] for c in text), dtype=np.int64, count=len(text))
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        """The text for a sequence of token ids."""
        ids = np.asarray(tokens, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{ids.min()}, {ids.max()}]")
        return "".join(self.chars[i] for i in ids)


def load_text(path: str | Path, block_size: int, val_fraction: float = 0.1) -> CharCorpus:
    """Read a UTF-8 text file; the first (1 - val_fraction) of the characters train, the rest validate."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    path = Path(path)
    if path.is_dir():
        inside = sorted(p for p in path.glob("*.txt") if p.is_file())
        if len(inside) != 1:  # a folder of one text file (Tiny Shakespeare's input.txt) is that file
            example = inside[0] if inside else path / "input.txt"
            held = f"{len(inside)} text files" if inside else "no .txt file"
            raise FileNotFoundError(f"text corpus {path} is a folder with {held}; pass the text file to train on, "
                                    f"e.g. --data-path {example}")
        path = inside[0]
    if not path.is_file():
        raise FileNotFoundError(f"text corpus {path} does not exist; pass the path of a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid UTF-8 text ({exc}); convert it to UTF-8 first") from exc
    if not text:
        raise ValueError(f"{path} is empty; a text corpus needs at least block_size+1 characters")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    n_train = int(len(tokens) * (1.0 - val_fraction))
    _check_windows(path, len(tokens), val_fraction, block_size)
    return CharCorpus(chars=chars, train=tokens[:n_train].copy(), val=tokens[n_train:].copy(), block_size=block_size)


def _check_windows(path: Path, total: int, val_fraction: float, block_size: int) -> None:
    """ValueError, in the file's words, when its training part or the rest, held out for validation (a
    ``val_fraction`` of its ``total`` characters), is shorter than one window of ``block_size`` + 1 characters."""
    n_train = int(total * (1.0 - val_fraction))
    shortest = min(n_train, total - n_train)
    if shortest > block_size:
        return
    # else the windows' refusal named the held-out tenth's length as the text's
    fix = f"a text of at least {_length_for(block_size, val_fraction)} characters" if val_fraction else "a longer text"
    smaller = f" or --block-size {shortest - 1} or less" if shortest > 1 else ""
    raise ValueError(f"{path} has {total} characters: its first {n_train} train and the other {total - n_train} "
                     f"validate, and each part needs block_size+1={block_size + 1}; use {fix}{smaller}")


def _length_for(block_size: int, val_fraction: float) -> int:
    """The fewest characters whose training part and held-out ``val_fraction`` both hold ``block_size`` + 1."""
    share = min(val_fraction, 1.0 - val_fraction)
    n = max(1, int((block_size + 1) / share - 2 / share))  # below the answer: int() rounds each part down
    while min(int(n * (1.0 - val_fraction)), n - int(n * (1.0 - val_fraction))) <= block_size:
        n += 1
    return n


def text_windows(tokens: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows: inputs (n, block_size) and targets shifted one token ahead."""
    n = (len(tokens) - 1) // block_size
    if n < 1:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than block_size+1={block_size + 1}; "
                         "use a longer text or a smaller --block-size")
    import torch

    t = torch.from_numpy(np.ascontiguousarray(tokens[: n * block_size + 1]))
    return t[:-1].view(n, block_size).clone(), t[1:].view(n, block_size).clone()


def text_train_data(name: str, data_path: str | Path | None, block_size: int, seed: int
                    ) -> tuple[TrainData, dict[str, Any]]:
    """The corpus at ``data_path`` as ``block_size``-character windows (the first 90% training), and the
    ``vocab_size`` and ``block_size`` it gives the model."""
    if not data_path:
        raise ValueError("--dataset text needs --data-path FILE (any UTF-8 text, e.g. "
                         "../shared/data/tinyshakespeare/input.txt)")
    corpus = load_text(data_path, block_size)
    x, y = text_windows(corpus.train, block_size)
    vx, vy = text_windows(corpus.val, block_size)
    return TrainData(x, y, vx, vy, LANGUAGE_MODEL), {"vocab_size": corpus.vocab_size, "block_size": block_size}


@register_dataset("text", help="a character corpus for language models: train (the gpt) --data-path FILE",
                  train=text_train_data, model="gpt")
def text_dataset(name: str) -> None:
    """``--dataset text`` where a classification set is read: refused, saying where it trains."""
    raise ValueError("text is a character corpus for language models, not a classification set: train the gpt "
                     "on it with fedpar train --model gpt --dataset text --data-path FILE, or federated with "
                     "--task fedpar.tasks.zoo:language_model --task-option data_path=FILE")
