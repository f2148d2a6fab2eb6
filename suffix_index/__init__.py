"""Suffix index: drafting source over request contexts, tenant histories and documents.

``SuffixIndex`` (index.py) wraps the native core ``suffix_index._core`` (C++17, nanobind);
``reference.py`` is the plain-Python specification the core is tested against.
"""

from .index import MAX_TOKEN_ID, SuffixIndex

__all__ = ["MAX_TOKEN_ID", "SuffixIndex"]
