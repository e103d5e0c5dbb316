"""Benchmarks: `igserve bench decode | serve | compare | report`; results under bench/results/."""
