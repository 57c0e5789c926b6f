"""What the tests and the benchmarks build on, never the engine: random-weight models at real Gemma 3 /
Gemma 4 sizes (`synthetic`), the KV layer specs of public checkpoints (`shapes`), teacher-forced scoring
and agreement figures (`scoring`), a drafter replaying a known continuation at a set acceptance rate
(`replay_drafts`), the Hugging Face reference over our weights (`hf_reference`) and the batch-invariance
probe (`invariance`).

Installed with the package (the CPU benchmarks of `gemmaserve bench` use it); of the package, only
`bench` imports it (tests/test_layering.py)."""
