"""Blocks that outlive the process: content addresses (:mod:`.keys`), the record format (:mod:`.record`),
and the persistent, content-addressed block store shared by processes (:mod:`.store`).

Nothing here imports transformers; :mod:`.keys` and :mod:`.record` import torch only inside the functions
that take or return tensors, so a process that only moves bytes (a crash-test writer) starts fast.
"""
