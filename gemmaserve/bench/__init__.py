"""The benchmarks users run, `gemmaserve bench <name>` (one module each, named in cli.py's BENCHMARKS,
with `add_arguments` and `run`), and their helpers: llama.cpp as the reference (`llama_cpp_ref`) and the
fixed workloads (`quality_texts`, `spec_texts`).

Also `gpu_check` and the GPU scripts' section runner (`sections`), kept here so that a GPU session still
starts with `python3 -m gemmaserve.bench.gpu_check`; the other GPU scripts are in the clone's top-level
benchmarks/ (not installed)."""
