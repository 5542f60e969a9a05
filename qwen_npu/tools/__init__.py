"""The command line, the demo, benchmarks and their workloads, and the environment report."""
