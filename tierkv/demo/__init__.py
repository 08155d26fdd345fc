"""The shipped demo model: a small Llama trained from scratch on synthetic long-context retrieval.

``task`` generates RULER-style passkey / multi-key needle-in-a-haystack prompts and owns the tokenizer,
``train`` trains the model, ``model`` loads the packaged weights and ``evaluate`` measures retrieval
accuracy over context lengths and needle depths. See ``docs/demo.md``.
"""
