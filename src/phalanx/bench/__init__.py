"""Benchmarks and the cost model: collectives (nccl-tests semantics), DDP throughput, the ring model."""
