"""The language server (``agentspec lsp``): rewrites and fast apply for LSP editors, with the
open buffers as the drafting workspace. See ``agentspec.lsp.server``."""

from .edits import apply_edits, line_edits

__all__ = ["apply_edits", "line_edits"]
