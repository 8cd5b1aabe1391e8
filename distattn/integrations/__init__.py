"""Integrations with other libraries; each lives in its own module and imports its library lazily.

``distattn.integrations.hf``: Hugging Face transformers 5.x (attention registration, input sharding, loss,
rematerialization-aware checkpointing, and ``SequenceParallelTrainer``: ``Trainer`` with data parallelism over
sequence-parallel groups, in ``_hf_trainer``/``_hf_data``).
``distattn.integrations.torchtitan``: torchtitan (0.3.0) models, by a ``ModelConfigConverter`` (``_titan_*``).
"""
