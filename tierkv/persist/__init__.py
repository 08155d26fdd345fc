"""Blocks that outlive the process: content addresses (:mod:`.keys`), the record format (:mod:`.record`),
the persistent, content-addressed block store shared by processes (:mod:`.store`, with :mod:`.manifest` and
:mod:`.lock`), a sequence's ids tied to its blocks (:mod:`.prefix`) and the conversation file
(:mod:`.conversation`). See docs/reliability.md for what each guarantees and how it is tested.

Nothing here imports transformers; :mod:`.keys`, :mod:`.record` and :mod:`.store` import torch only inside
the functions that take or return tensors, so a process that only moves bytes (a crash-test writer) starts
fast.
"""
