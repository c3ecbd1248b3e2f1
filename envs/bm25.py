"""A small Okapi BM25 text index (used by WebShop's product search).

WebShop searches products with a Lucene BM25 index (pyserini); this is the
same ranking function in plain Python, enough for catalogs of a few
thousand products without a Java dependency.
"""

from __future__ import annotations

import math
import re
from collections import Counter

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens."""
    return _TOKEN.findall(text.lower())


class BM25Index:
    """Okapi BM25 over a list of documents (k1=1.2, b=0.75 as in Lucene)."""

    def __init__(self, docs: list[str], k1: float = 1.2, b: float = 0.75):
        """Index ``docs``; results refer to documents by their position."""
        self.k1, self.b = k1, b
        self.term_freqs = [Counter(tokenize(d)) for d in docs]
        self.doc_lens = [sum(tf.values()) for tf in self.term_freqs]
        self.avg_len = sum(self.doc_lens) / max(len(docs), 1)
        df: Counter = Counter()
        for tf in self.term_freqs:
            df.update(tf.keys())
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}
        self.postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self.term_freqs):
            for t in tf:
                self.postings.setdefault(t, []).append(i)

    def search(self, query: str, k: int = 50) -> list[tuple[int, float]]:
        """Top-k (doc index, score) with score > 0, best first (ties by index)."""
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for i in self.postings[term]:
                tf = self.term_freqs[i][term]
                norm = tf + self.k1 * (1 - self.b + self.b * self.doc_lens[i] / self.avg_len)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1) / norm
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        return ranked[:k]
