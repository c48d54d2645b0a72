"""The one error type of the data pipeline.

Every mistake a user can make with data (a file that cannot be read, a JSON key that is not
there, a token store that was truncated by a full disk) raises ``DataError`` with one
sentence that names the file, what is wrong and how to fix it. The ``meshlm`` command prints
that sentence without a traceback.
"""

from __future__ import annotations


class DataError(ValueError):
    """Input text, a tokenizer's output or a token store on disk is wrong; the message names the file."""
