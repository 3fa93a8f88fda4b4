"""The lean decode step's earlier import path: it lives in :mod:`dppo_core.engines.lean_decode` now.

Kept so that code written against the earlier layout (``from dppo_core.lean_decode import LeanDecoder``) keeps
working; new code imports from :mod:`dppo_core.engines.lean_decode`.
"""

from dppo_core.engines.lean_decode import LeanDecoder, compare_with_forward

__all__ = ["LeanDecoder", "compare_with_forward"]
