"""The real peers on the same work as distattn: one harness, one byte counter, one memory measure (issue 37).

``workload`` describes the work (shapes, GQA, mask, P, dtype) and builds the global tensors and the fp64
one-process reference; ``measure`` counts ``torch.distributed`` bytes and saved/live memory the same way for every
system; ``adapters`` call each system's real entry point as its users do (with the patches a peer needs on CPU, each
one a named function listed in the results); ``harness`` runs one system x workload in its own spawned process
group under a deadline and always returns a row (on the CPU, or with ``--device cuda`` on the GPU: the ranks share
it over gloo with CUDA tensors); ``python -m bench.peers`` writes ``bench/results/peers/``. A part of
the benchmark layer: imports distattn and the peers' packages, and is never imported by ``distattn/``.
"""
