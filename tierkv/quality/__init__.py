"""Quality of approximate attention against full attention, on the same prompts.

``tasks`` builds the prompts (needles in real text for a real tokenizer, the demo model's own synthetic
haystacks for the demo model, and real-text continuations for the fidelity measure), ``text`` supplies the
real text (the Python Language Reference that ships with CPython as ``pydoc_data.topics``), ``metrics``
scores answers and compares next-token distributions, and ``harness`` runs full attention and tierkv's
sparse executor over them. kvpress runs the same prompts in its own environment
(``benchmarks/quality/kvpress_run.py``); ``report`` puts every method side by side. See docs/quality.md.
"""
