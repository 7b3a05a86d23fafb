"""One ps shard's part of a sparse embedding table: rows by int64 id, created on first touch.

Not yet served over the protocol: ``psdk/ps/tables/table.py`` (``RowTable``) is the
store a later session puts behind pull-by-ids and push-of-rows (docs/tables.md).
"""
