"""Private alias of the old path: the file readers moved to :mod:`lit_seqpack.data.sources._files`."""

from lit_seqpack.data.sources._files import file_fingerprint, text_lines

__all__ = ["file_fingerprint", "text_lines"]
