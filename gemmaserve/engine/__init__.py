"""The engine: requests in, outputs out (ARCHITECTURE.md).

The core: `LLM` (llm.py) and `LLMEngine` (llm_engine.py), the scheduler, the model runner and the plain data
between them (step.py, request.py, sampling_params.py), the sampler, the input and output processors. The
rooms hold the rest: spec_decode/, compile/, media/, executor/, structured/, connectors/.
"""
