"""The serving benchmark: S-LoRA-style workloads, the systems compared, metrics and the report.

`loraplex bench --preset small` runs it (see `loraplex.bench.run`)."""
