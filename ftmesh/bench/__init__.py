"""Benchmarks that compare ftmesh against a peer measured in the same run."""
