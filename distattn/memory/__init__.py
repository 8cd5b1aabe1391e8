"""Activation and training-step memory: measure it exactly, model it byte for byte, plan what fits.

* :mod:`distattn.memory.measure` — ``saved_activations`` (bytes saved for backward, one count per storage)
  and ``allocator_delta`` (CUDA allocator counters around a region).
* :mod:`distattn.memory.model` — per-layer saved tensors (name, shape, dtype) of LLaMA-family and GPT-style
  layers per attention implementation and checkpointing strategy, steady state and step peak.
* :mod:`distattn.memory.executor` — the attention executor's own buffers, a replay of the plan it runs.
* :mod:`distattn.memory.techniques` — tiles, offload and FSDP2's extra buffers in the step's peak.
* :mod:`distattn.memory.plan` — the longest sequence that fits; :mod:`distattn.memory.cli` its command line
  (``python -m distattn.memory plan ...``).
* ``measure.live_bytes`` — the peak live bytes of a region on any device (how the executor's buffers are measured).
"""

from distattn.memory.measure import AllocatorDelta, SavedActivations, SavedStorage, allocator_delta, saved_activations
from distattn.memory.model import (LayerSpec, ModelSpec, Saved, StepPeak, activation_bytes, layer_saved_tensors,
                                   model_saved_tensors, steady_state_bytes, step_peak)
from distattn.memory.plan import check_fits, model_spec, predicted_peak_bytes

__all__ = ["saved_activations", "SavedActivations", "SavedStorage", "allocator_delta", "AllocatorDelta", "LayerSpec",
           "ModelSpec", "Saved", "StepPeak", "layer_saved_tensors", "model_saved_tensors", "activation_bytes",
           "steady_state_bytes", "step_peak", "predicted_peak_bytes", "check_fits", "model_spec"]
