"""Document lengths drawn from a real pretraining corpus's published statistics: the Pile's mixture.

Source: L. Gao et al., "The Pile: An 800GB Dataset of Diverse Text for Language Modeling", arXiv:2101.00027 (2020),
Table 1: for each of the 22 components, its weight in training (the share of the effective, epoch-weighted bytes) and
its mean document size in KiB. :data:`PILE` holds those two columns as published. What is ours (assumed, not from
the paper): bytes per token (``pile:B``, 4 by default, about GPT-2 BPE on English) and, inside a component, an
exponential spread of lengths around the published mean (the paper gives means only). A document is drawn by
picking a component with probability proportional to its *number* of documents (weight / mean size), then a length.

The result is what packing a Pile-like stream meets: most documents are short web and abstract pages (a few hundred
to a thousand tokens) while Books3, Gutenberg, BookCorpus2 and Ubuntu IRC bring documents of ~100K tokens that hold
much of the stream's tokens. Pure Python + numpy; imports nothing of distattn.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PILE", "pile_lengths"]

PILE = (  # (component, weight in training %, mean document size KiB): arXiv:2101.00027, Table 1
    ("Pile-CC", 18.11, 4.33), ("PubMed Central", 14.40, 30.55), ("Books3", 12.07, 538.36),
    ("OpenWebText2", 10.01, 3.85), ("ArXiv", 8.96, 46.61), ("Github", 7.59, 5.25), ("FreeLaw", 6.12, 15.06),
    ("StackExchange", 5.13, 2.16), ("USPTO Backgrounds", 3.65, 4.08), ("PubMed Abstracts", 3.07, 1.30),
    ("Gutenberg (PG-19)", 2.17, 398.73), ("OpenSubtitles", 1.55, 30.48), ("Wikipedia (en)", 1.53, 1.11),
    ("DM Mathematics", 1.24, 8.00), ("Ubuntu IRC", 0.88, 545.48), ("BookCorpus2", 0.75, 369.87),
    ("EuroParl", 0.73, 68.87), ("HackerNews", 0.62, 4.92), ("YoutubeSubtitles", 0.60, 22.55),
    ("PhilPapers", 0.38, 73.37), ("NIH ExPorter", 0.30, 2.11), ("Enron Emails", 0.14, 1.78),
)


def pile_lengths(rng: np.random.Generator, count: int, bytes_per_token: int = 4) -> np.ndarray:
    """``count`` document lengths in tokens (int64, >= 1) of the Pile's mixture (module docstring)."""
    weight = np.array([w for _, w, _ in PILE])
    mean_tokens = np.array([kib for _, _, kib in PILE]) * 1024 / bytes_per_token
    docs = weight / mean_tokens  # documents per unit of training bytes
    part = rng.choice(len(PILE), size=count, p=docs / docs.sum())
    return np.maximum(1, rng.exponential(mean_tokens[part]).astype(np.int64))
