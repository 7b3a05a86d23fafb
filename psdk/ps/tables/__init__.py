"""Embedding tables on the ps: rows by int64 id, created on first touch, trained a batch's rows at a time.

``table.py`` keeps one shard's rows (``RowTable``); ``served.py`` checks what
a request sends and runs the job's rule on the touched rows; ``requests.py``
reads the ``tables`` part of a request; ``setup.py`` places the chief's tables
at ``init`` (docs/tables.md).
"""
