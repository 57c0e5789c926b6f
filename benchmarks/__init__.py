"""Benchmarks developers run from a clone, not installed with the package: the GPU scripts
(`gpu_*`: random weights at real sizes, checks whose failures set the exit status) and CPU timings
kept for one question each (`compiled_rows`, `output_cost`).

Run them as modules from the repository root, e.g. `python3 -m benchmarks.gpu_bench roofline`; each
writes its JSON to $OUT (or bench-out/). They import the package by absolute names (`gemmaserve....`);
the GPU correctness check stays in the package, `python3 -m gemmaserve.bench.gpu_check`, and the
benchmarks users run are `gemmaserve bench ...`."""
