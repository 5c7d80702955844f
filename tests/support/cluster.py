"""The real Redis Cluster / Valkey cluster the tests start (:mod:`gpulock._local_cluster`, which
the benchmarks use too)."""

from gpulock._local_cluster import Cluster, start_cluster

__all__ = ["Cluster", "start_cluster"]
