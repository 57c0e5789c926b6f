"""Steps compiled ahead of running them: CUDA graphs on the GPU, compiled decode steps on the CPU.

    cuda_graphs.py, direct_graph.py     captured decode graphs and calling a compiled graph without Dynamo
    compiled_decode.py                  CPU decode steps compiled in this process (torch.compile)
    aot_decode.py, build_job.py         CPU decode steps as AOTInductor packages: built by a background process
                                        (engine/aot_builder.py, above this room), kept in the cache
    compiled_steps.py                   an engine's compiled CPU steps over its life: load, build, switch

Every compiled step gives the eager step's bits; the runner falls back to eager steps where none applies.
"""
